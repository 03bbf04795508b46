# bash completion for edgespool(1), generated from the table of commands
# (src/cli/spec.rs, what `edgespool help COMMAND` prints): do not edit;
# `EDGESPOOL_BLESS=1 cargo test --lib docs_gen` rewrites it.
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
        --config|-c|--spool|--to|--db|--pg-password-file|--pg-ca|--pg-cert|--pg-key|--receipt-key|--password-file|--out)
            _filedir
            return ;;
        --dir)
            _filedir -d
            return ;;
        --set|--url|--topic|--postgres|--client-id|--share|--batch-max|--batch-ms|--username)
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
    # The bare config file some commands take instead of --config.
    if [[ "$cur" != -* ]] && [[ "${words[1]}" == check-config || "${words[1]}" == test ]]; then
        _filedir toml
        return
    fi
    COMPREPLY=($(compgen -W "$opts" -- "$cur"))
} &&
complete -F _edgespool edgespool
