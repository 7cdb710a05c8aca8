#!/usr/bin/env bash
# tokenizer.sh — tinymoe's byte-level BPE against the `tokenizers` package, in one run (issue 23):
# encoding MB/s on one thread (target >= 1x) and the training time of `tokenize --bpe N`
# against tokenizers' BpeTrainer on the same corpus and vocabulary size (target <= 2x).
#
#   bench/tokenizer.sh [--vocab N] [--big-vocab M] [--mb MB] [--reps R] [--dir DIR]
#
# Corpora: tinyshakespeare (../shared/data/tinyshakespeare.txt beside the checkout, or $TS;
# without it a generated English-like text of the same size, bench/tokenizer_ref.py `prose`)
# and a generated multilingual text of MB megabytes (default 4: Latin, Greek, Cyrillic, CJK,
# emoji, numbers, source lines; `mixed`).
# Tokenizers: the one `tokenize --bpe N` trains on the multilingual corpus (N = 8192), and a
# GPT-2-style one that tokenizers' BpeTrainer trains there (M = 32768 ids, its own id order:
# a file of the library's making; GPT-2's own tokenizer.json needs the Hugging Face hub).
# Encoding: build/bench/tokenizer (tmd_bpe_encode of the whole text) against
# Tokenizer.encode of the whole text and encode_batch of its lines (the ratio is against the
# faster), and tiktoken with the same vocabulary when importable; each says whether its ids
# equal tinymoe's. Training: build/bench/tokenizer train (read, split, count, merge, write the
# JSON) against BpeTrainer (read, split, count, merge). Every time is the best of R runs.
# The reference runs with TOKENIZERS_PARALLELISM=false (one thread, as tinymoe's code is);
# a last row gives BpeTrainer on all cores for scale. Python: $PYTHON, else .pyenv/bin/python
# (scripts/install-pydeps.sh), else python3; it needs tokenizers.
set -euo pipefail
cd "$(dirname "$0")/.."
vocab=8192 big=32768 mb=4 reps=3 dir=""
while [ $# -gt 0 ]; do
    case "$1" in
        --vocab) vocab=$2; shift 2 ;;
        --big-vocab) big=$2; shift 2 ;;
        --mb) mb=$2; shift 2 ;;
        --reps) reps=$2; shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        -h|--help) sed -n 2,25p "$0"; exit 0 ;;
        *) echo "tokenizer.sh: unknown argument '$1'" >&2; exit 2 ;;
    esac
done
py=${PYTHON:-}
[ -n "$py" ] || { [ -x .pyenv/bin/python ] && py=.pyenv/bin/python; } || py=python3
if ! "$py" -c 'import tokenizers' 2>/dev/null; then
    echo "tokenizer.sh: $py cannot import tokenizers: run scripts/install-pydeps.sh (or set PYTHON)" >&2
    exit 3
fi
make -s -j2 build/bench/tokenizer >/dev/null
[ -n "$dir" ] || dir=$(mktemp -d "${TMPDIR:-/tmp}/tokbench.XXXXXX")
mkdir -p "$dir"
export TOKENIZERS_PARALLELISM=false
ref() { "$py" bench/tokenizer_ref.py "$@"; }
ours=build/bench/tokenizer

ts=${TS:-../shared/data/tinyshakespeare.txt}
if [ -f "$ts" ]; then
    ts_name=tinyshakespeare
else
    ts=$dir/prose.txt ts_name="prose (generated)"
    ref corpus prose "$ts" 1115394
fi
mixed=$dir/mixed.txt
ref corpus mixed "$mixed" $((mb * 1000000))
mbytes() { awk -v b="$(stat -c %s "$1")" 'BEGIN { printf "%.2f", b / 1e6 }'; }
field() { awk -v k="$1" '$1 == k { print $2 }'; }

echo "tinymoe BPE against tokenizers $("$py" -c 'import tokenizers; print(tokenizers.__version__)'), one thread;" \
     "$(date -u +%Y-%m-%d), $(nproc) cores: $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)"
echo
echo "Training: tokenize --bpe N against BpeTrainer (ByteLevel, same N), seconds (best of $reps)"
printf '%-20s %7s %6s %9s %11s %7s %s\n' corpus MB N tinymoe tokenizers "t ratio" "same merge count"
train_row() { # corpus-name file N
    local o r
    o=$($ours train "$2" "$3" "$dir/ours_train.json" "$reps")
    r=$(ref train "$2" "$3" "$dir/ref_train.json" "$reps")
    local so sr mo mr
    so=$(echo "$o" | field seconds) sr=$(echo "$r" | field seconds)
    mo=$(echo "$o" | awk '{ print $4 }') mr=$(echo "$r" | awk '{ print $4 }')
    printf '%-20s %7s %6s %9.3f %11.3f %6.2fx %s\n' "$1" "$(mbytes "$2")" "$3" "$so" "$sr" \
        "$(awk -v a="$so" -v b="$sr" 'BEGIN { print a / b }')" "$([ "$mo" = "$mr" ] && echo "yes ($mo)" || echo "no ($mo, $mr)")"
}
train_row "$ts_name" "$ts" "$vocab"
train_row "mixed (generated)" "$mixed" "$vocab"
train_row "mixed (generated)" "$mixed" "$big"
par=$(TOKENIZERS_PARALLELISM=true ref train "$mixed" "$big" "$dir/ref_par.json" 1 | field seconds)
echo "(BpeTrainer on all $(nproc) cores, mixed, $big: $par s)"

# the tokenizers to encode with
$ours train "$mixed" "$vocab" "$dir/tinymoe_$vocab.json" 1 >/dev/null
ref train "$mixed" "$big" "$dir/tokenizers_$big.json" 1 >/dev/null
echo
echo "Encoding: MB/s of the whole text (best of $reps); ratio: tinymoe against the faster of tokenizers' encode and encode_batch"
printf '%-36s %-20s %8s %9s %9s %6s %9s %7s\n' tokenizer corpus tinymoe encode batch ratio tiktoken "same ids"
enc_row() { # tokenizer-name file corpus-name file
    local o r so n
    o=$($ours encode "$2" "$4" "$reps" "$dir/ids.u32")
    so=$(echo "$o" | field seconds)
    r=$(ref encode "$2" "$4" "$reps" "$dir/ids.u32")
    local b e bt tk same
    b=$(stat -c %s "$4")
    e=$(echo "$r" | field encode) bt=$(echo "$r" | field batch) tk=$(echo "$r" | field tiktoken)
    same=$(echo "$r" | awk '{ printf "%s%s", (NR > 1 ? "/" : ""), $4 }')
    awk -v n1="$1" -v n2="$3" -v b="$b" -v so="$so" -v e="$e" -v bt="$bt" -v tk="$tk" -v same="$same" 'BEGIN {
        best = e < bt ? e : bt
        printf "%-36s %-20s %8.2f %9.2f %9.2f %5.1fx %9s %7s\n", n1, n2, b / so / 1e6, b / e / 1e6, b / bt / 1e6,
            best / so, tk == "" ? "-" : sprintf("%.2f", b / tk / 1e6), same }'
}
for tk in "tinymoe --bpe $vocab (mixed)|$dir/tinymoe_$vocab.json" "tokenizers BpeTrainer $big (mixed)|$dir/tokenizers_$big.json"; do
    enc_row "${tk%%|*}" "${tk#*|}" "$ts_name" "$ts"
    enc_row "${tk%%|*}" "${tk#*|}" "mixed (generated)" "$mixed"
done
echo "(same ids: encode/batch/tiktoken against tinymoe's; batch may differ where spaces meet a line end)"
echo "files: $dir"
