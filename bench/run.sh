#!/bin/sh
# run.sh — CPU training throughput of tinymoe beside PyTorch, same model, same settings, one run.
#
#   bench/run.sh [--threads N] [--steps N] [--warmup N] [--batch B] [--seq T] [--repeat R]
#   make bench BENCH_ARGS='--threads 2 --steps 30'
#
# Builds bench/train_cpu (through make, unless TM_BENCH_BIN names a built binary), runs it and
# bench/torch_moe.py with the same options, and prints a table with tokens/s, ms/step and the
# ratio tinymoe / pytorch. Both get the same thread count, also through OMP_NUM_THREADS and
# OPENBLAS_NUM_THREADS so that no BLAS starts more threads than asked. --repeat R alternates
# the runs R times and keeps each one's best (a shared machine only ever makes runs slower).
#
# Each runs twice: as installed, and with OMP_WAIT_POLICY=passive. Spinning OpenMP workers
# help when the cores are idle and hurt when they are shared; and Debian's torch pairs its
# OpenMP pool with the pthreads build of OpenBLAS, whose threads then compete with the spinning
# workers, so passive waiting is PyTorch's better setting on such a system (tinymoe links the
# OpenMP build of OpenBLAS: one pool). The headline ratio is best against best; the table also
# gives it for each setting. PYTHON selects the interpreter (default /usr/bin/python3, the
# one Debian's python3-torch installs into).
set -eu

cd "$(dirname "$0")/.."

threads=2 steps=20 warmup=3 batch=16 seq=128 repeat=1
while [ $# -gt 0 ]; do
    case "$1" in
    --threads|--steps|--warmup|--batch|--seq|--repeat)
        [ $# -ge 2 ] || { echo "run.sh: $1 needs a value" >&2; exit 2; }
        case "$2" in ''|*[!0-9]*) echo "run.sh: $1 must be a non-negative integer, got '$2'" >&2; exit 2 ;; esac
        eval "${1#--}=\$2"
        shift 2 ;;
    -h|--help)
        sed -n '2,20s/^# \{0,1\}//p' "$0"
        exit 0 ;;
    *)
        echo "run.sh: unknown option '$1' (--threads, --steps, --warmup, --batch, --seq, --repeat)" >&2
        exit 2 ;;
    esac
done
[ "$repeat" -ge 1 ] || { echo "run.sh: --repeat must be >= 1" >&2; exit 2; }
PYTHON=${PYTHON:-/usr/bin/python3}

bin=${TM_BENCH_BIN:-}
if [ -z "$bin" ]; then
    build=${BUILD:-build}
    make -s BUILD="$build" "$build/bench/train_cpu" >&2
    bin=$build/bench/train_cpu
fi

export OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"
args="--threads $threads --steps $steps --warmup $warmup --batch $batch --seq $seq"

have_torch=0
if "$PYTHON" -c 'import torch' >/dev/null 2>&1; then have_torch=1; fi

# field NAME LINE: the value of NAME=... in a RESULT line
field() { printf '%s\n' "$2" | tr ' ' '\n' | sed -n "s/^$1=//p"; }

# run LABEL CMD...: run, echo its human line, keep the RESULT line with the most tokens/s in
# the variable best_<LABEL>.
run() {
    label=$1
    shift
    out=$("$@") || { echo "run.sh: $label failed: $*" >&2; exit 1; }
    printf '%s\n' "$out" | grep -v '^RESULT ' | sed "s/^/  /"
    line=$(printf '%s\n' "$out" | grep '^RESULT ')
    eval "prev=\${best_$label:-}"
    if [ -z "$prev" ] || awk -v a="$(field tokens_per_s "$line")" -v b="$(field tokens_per_s "$prev")" \
        'BEGIN { exit !(a > b) }'; then
        eval "best_$label=\$line"
    fi
}

echo "tinymoe: $bin $args"
[ "$have_torch" = 1 ] && echo "pytorch: $PYTHON bench/torch_moe.py $args"
i=0
while [ "$i" -lt "$repeat" ]; do
    i=$((i + 1))
    [ "$repeat" -gt 1 ] && echo "-- round $i of $repeat"
    run tinymoe "$bin" $args
    run tinymoe_passive env OMP_WAIT_POLICY=passive "$bin" $args
    if [ "$have_torch" = 1 ]; then
        run torch "$PYTHON" bench/torch_moe.py $args
        run torch_passive env OMP_WAIT_POLICY=passive "$PYTHON" bench/torch_moe.py $args
    fi
done

tok() { field tokens_per_s "$1"; }
ratio() { awk -v a="$(tok "$1")" -v b="$(tok "$2")" 'BEGIN { printf "%.2f", a / b }'; }
best() { awk -v a="$(tok "$1")" -v b="$(tok "$2")" 'BEGIN { exit !(a >= b) }' && echo "$1" || echo "$2"; }
row() { # LABEL RESULT-LINE RATIO
    printf '%-24s %9s %10s %9s %16s\n' "$1" "$(field params "$2")" "$(tok "$2")" "$(field ms_per_step "$2")" "$3"
}

echo
printf '%-24s %9s %10s %9s %16s\n' impl params tokens/s ms/step tinymoe/pytorch
if [ "$have_torch" = 1 ]; then
    row tinymoe "$best_tinymoe" "$(ratio "$best_tinymoe" "$best_torch")"
    row "tinymoe (omp passive)" "$best_tinymoe_passive" "$(ratio "$best_tinymoe_passive" "$best_torch_passive")"
    row pytorch "$best_torch" ""
    row "pytorch (omp passive)" "$best_torch_passive" ""
    tm=$(best "$best_tinymoe" "$best_tinymoe_passive")
    pt=$(best "$best_torch" "$best_torch_passive")
    echo
    echo "tinymoe/pytorch, best setting of each: $(ratio "$tm" "$pt")  ($(tok "$tm") vs $(tok "$pt") tokens/s)"
    echo "RATIO best=$(ratio "$tm" "$pt") default=$(ratio "$best_tinymoe" "$best_torch")" \
         "passive=$(ratio "$best_tinymoe_passive" "$best_torch_passive") tinymoe_tokens_per_s=$(tok "$tm")" \
         "pytorch_tokens_per_s=$(tok "$pt") threads=$threads batch=$batch seq=$seq steps=$steps repeat=$repeat"
else
    row tinymoe "$best_tinymoe" "-"
    row "tinymoe (omp passive)" "$best_tinymoe_passive" "-"
    echo "pytorch: not installed (apt-get install python3-torch)"
fi
