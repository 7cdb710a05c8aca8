#!/usr/bin/env bash
# scripts/check-readme.sh — run the README's shell blocks that need no GPU, in order, as a new
# user would on a fresh machine, so that what the README tells people keeps working.
#
#   scripts/check-readme.sh [BUILD_DIR]      (make readme; part of make test)
#
# Skipped: the blocks that install dependencies, build or run the test suite (make test runs this
# script), the install / pkg-config block (make examples builds every example by its own
# header's line against a staged install), and lines that need a GPU (--device cuda) or a file
# the README leaves to the user. Run in a scratch directory where ./build is the build, and
# input.txt is English text (the repository's own docs, since any text file works). One change
# to the commands as written, to bound CI's time: every 'tinymoe train' gets
# '--steps 30 --eval_every 15 --sample_tokens 40' appended (flags win over presets), so a
# preset's 1000 steps become 30; resuming such a run continues it. The lines that name
# tokenizer.json get one trained on input.txt with the README's own Python block, by a Python
# that has tokenizers ($TM_PYTHON, .pyenv/bin/python of scripts/install-pydeps.sh, or python3);
# without one they are skipped, saying so.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
[ -x "$build/tinymoe" ] || { echo "check-readme: $build/tinymoe is missing (make)" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/tinymoe_readme.XXXXXX")
trap 'rm -rf "$work"' EXIT
ln -s "$build" "$work/build"
cat "$root"/README.md "$root"/docs/*.md > "$work/input.txt"
cap='--steps 30 --eval_every 15 --sample_tokens 40'
# CI runs as root; Open MPI refuses root unless told (a user's own account needs nothing)
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
n=0 ran=0
# The README's python block trains tokenizer.json on input.txt (2048 tokens: 3 s here).
awk '/^```python$/ {f = 1; next} /^```/ {f = 0} f' "$root/README.md" > "$work/train_tokenizer.py"
py=""
for c in "${TM_PYTHON:-}" "$root/.pyenv/bin/python" python3; do
    [ -n "$c" ] && "$c" -c 'import tokenizers' 2>/dev/null && { py=$c; break; }
done
if [ -n "$py" ] && (cd "$work" && "$py" train_tokenizer.py) > "$work/tok.log" 2>&1; then
    echo "made  tokenizer.json with the README's python block ($py)"
else
    echo "no tokenizer.json (a Python with tokenizers: scripts/install-pydeps.sh): $(tail -1 "$work/tok.log" 2>/dev/null)"
fi
# The blocks, one command per line (comments and blank lines dropped), with their line numbers.
awk '/^```sh$/ {f = 1; b++; next} /^```/ {f = 0} f {print b "\t" NR "\t" $0}' "$root/README.md" > "$work/blocks"
while IFS=$'\t' read -r block line cmd; do
    cmd=${cmd%%  #*}                        # a trailing comment
    case "$cmd" in ''|'#'*) continue ;; esac
    n=$((n + 1))
    # 'install && make && ./build/tinymoe train': the build parts are make test's; run the rest
    if [[ "$cmd" == *'&&'* ]]; then
        rest=""
        IFS='&' read -ra parts <<< "${cmd//&&/&}"
        for p in "${parts[@]}"; do
            p=$(echo "$p" | sed 's/^ *//; s/ *$//')
            case "$p" in *install-deps.sh*|make|'make '*) ;; *) rest=${rest:+$rest && }$p ;; esac
        done
        [ -n "$rest" ] && cmd=$rest
    fi
    case "$cmd" in
        *install-deps.sh*|*'make '*|make|*pkg-config*|*'export PKG_CONFIG_PATH'*|'cc '*)
            echo "skip  README.md:$line (build / install: make test and make examples cover it)"; continue ;;
        *'--device cuda'*)
            echo "skip  README.md:$line (needs a GPU)"; continue ;;
        *mpirun*)
            command -v mpirun >/dev/null 2>&1 || { echo "skip  README.md:$line (no mpirun)"; continue; } ;;
        *tokenizer.json*|*subwords*)
            [ -f "$work/tokenizer.json" ] || { echo "skip  README.md:$line (no tokenizer.json)"; continue; } ;;
    esac
    run=$cmd
    case "$cmd" in
        *'tinymoe train'*) run="$cmd $cap" ;;
    esac
    echo "run   README.md:$line: $cmd"
    if ! (cd "$work" && eval "$run") < /dev/null > "$work/out.log" 2>&1; then
        echo "check-readme: README.md:$line failed: $cmd" >&2
        tail -20 "$work/out.log" >&2
        exit 1
    fi
    ran=$((ran + 1))
done < "$work/blocks"
echo "check-readme: $ran of $n README commands ran as written (train capped: $cap)"
