# bash completion for edgespool(1)
_edgespool() {
    local cur prev words cword
    _init_completion || return
    local cmds="run check-config test status probe-storage sink help --version --help"
    if [ "$cword" -eq 1 ]; then
        COMPREPLY=($(compgen -W "$cmds" -- "$cur"))
        return
    fi
    case "$prev" in
        --config|-c|--spool|--db|--password-file|--pg-ca|--pg-cert|--pg-key)
            _filedir
            return ;;
        --dir)
            _filedir -d
            return ;;
        --set|--url|--topic|--client-id|--share|--username|--postgres|--batch-max|--batch-ms)
            return ;;
    esac
    local opts
    case "${words[1]}" in
        run) opts="--config --set --check-spool --help" ;;
        test) opts="--config --set --help" ;;
        check-config)
            opts="--set --sample --help"
            if [[ "$cur" != -* ]]; then _filedir toml; return; fi ;;
        status) opts="--config --spool --json --help" ;;
        probe-storage) opts="--config --dir --json --help" ;;
        sink) opts="--url --topic --db --postgres --client-id --share --batch-max --batch-ms --no-receipts --username --password-file --pg-ca --pg-cert --pg-key --stats --json --help" ;;
    esac
    COMPREPLY=($(compgen -W "$opts" -- "$cur"))
} &&
complete -F _edgespool edgespool
