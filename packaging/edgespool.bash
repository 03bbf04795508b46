# bash completion for edgespool(1). Each command's options are the ones
# `edgespool help COMMAND` lists (a test holds this file against them).
_edgespool() {
    local cur prev words cword
    _init_completion || return
    local cmds="run check-config test status probe-storage export sink keygen help --version --help"
    if [ "$cword" -eq 1 ]; then
        COMPREPLY=($(compgen -W "$cmds" -- "$cur"))
        return
    fi
    # Options that take a value: complete the value, not an option.
    case "$prev" in
        --config|-c|--spool|--to|--out|--receipt-key|--db|--password-file|--pg-password-file|--pg-ca|--pg-cert|--pg-key)
            _filedir
            return ;;
        --dir)
            _filedir -d
            return ;;
        --set|--url|--topic|--client-id|--share|--username|--postgres|--batch-max|--batch-ms)
            return ;;
    esac
    local opts=""
    case "${words[1]}" in
        run) opts="--config --set --check-spool --help" ;;
        check-config) opts="--config --set --sample --help" ;;
        test) opts="--config --set --help" ;;
        status) opts="--config --spool --json --help" ;;
        probe-storage) opts="--config --dir --json --help" ;;
        export) opts="--config --spool --to --help" ;;
        sink) opts="--config --url --topic --db --postgres --pg-password-file --pg-ca --pg-cert --pg-key --client-id --share --batch-max --batch-ms --receipt-key --no-receipts --username --password-file --stats --json --help" ;;
        keygen) opts="--out --help" ;;
        help)
            [ "$cword" -eq 2 ] && COMPREPLY=($(compgen -W "run check-config test status probe-storage export sink keygen" -- "$cur"))
            return ;;
    esac
    if [[ "$cur" != -* ]] && [[ "${words[1]}" == check-config || "${words[1]}" == test ]]; then
        _filedir toml
        return
    fi
    COMPREPLY=($(compgen -W "$opts" -- "$cur"))
} &&
complete -F _edgespool edgespool
