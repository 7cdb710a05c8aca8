#!/usr/bin/env bash
# tests/gpu/dist.sh — the CUDA engines of distributed training on a machine with one GPU:
#   1. the CPU, one process (the reference);
#   2. CUDA, one rank through the NCCL engine (--nccl always makes a one-rank NCCL world);
#   3. CUDA, 2 ranks sharing the GPU (host-staged MPI engine), data parallel, ZeRO-1;
#   4. CUDA, 4 ranks sharing the GPU, ep_size 2 (alltoall), ZeRO-1.
# Each run trains 10 steps of the same tiny model on the same global batches; the losses must
# equal the CPU's within 1e-3 relative (CUDA f32 against the CPU: summation orders differ, as in
# tests/gpu/e2e.sh). Needs build/tinymoe built with CUDA and MPI (NCCL for step 2), and mpirun.
#   bash tests/gpu/dist.sh            (from the repository root; logs in $OUT, default /tmp/tinymoe-gpu-dist)
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tinymoe-gpu-dist}
rm -rf "$OUT" && mkdir -p "$OUT"
BIN=./build/tinymoe
MPIRUN="mpirun --oversubscribe --allow-run-as-root"
ARGS="--preset tiny --n_layers 2 --steps 10 --batch_size 8 --threads 2 --log_every 1 --eval_every 0 --eval_batches 1
      --lr_schedule constant --warmup_steps 0 --keep_last 1"
fail=0
run() { # name, then the command
    local name=$1; shift
    echo "== $name: $*"
    if ! timeout 600 "$@" --out "$OUT/$name" >"$OUT/$name.log" 2>&1; then
        echo "   FAILED (exit $?); tail of $OUT/$name.log:"; tail -20 "$OUT/$name.log"; fail=1; return 1
    fi
    grep -E "^distributed|collectives on" "$OUT/$name.log" | head -1
    return 0 # a one-process run prints no "distributed" line: that is no failure
}
losses() { grep '"type": "train"' "$OUT/$1/metrics.jsonl" | sed 's/.*"loss": \([^,]*\),.*/\1/'; }
compare() { # name
    paste <(losses cpu) <(losses "$1") | awk -v n="$1" '
        { r = ($1 - $2) / $1; if (r < 0) r = -r; if (r > m) m = r; k++ }
        END { printf "   %s: %d steps, largest relative loss difference to the CPU %.3g\n", n, k, m;
              exit (k != 10 || m > 1e-3) }' || fail=1
}
# the collective ops on CUDA tensors against CPU tensors, 1 rank (NCCL) and 2 ranks (host-staged)
for np in 1 2; do
    echo "== collectives on CUDA tensors, $np rank(s)"
    if ! timeout 300 $MPIRUN -np $np ./build/tinymoe_dist_helper cuda $([ $np = 1 ] && echo always || echo auto) \
            >"$OUT/cuda$np.log" 2>&1; then
        echo "   FAILED; tail of $OUT/cuda$np.log:"; tail -20 "$OUT/cuda$np.log"; fail=1
    else
        grep "^cuda" "$OUT/cuda$np.log"
    fi
done
run cpu $BIN train $ARGS
run nccl1 $BIN train $ARGS --device cuda --nccl always && compare nccl1
run staged2 $MPIRUN -np 2 $BIN train $ARGS --device cuda --zero 1 && compare staged2
run staged4 $MPIRUN -np 4 $BIN train $ARGS --device cuda --ep_size 2 --zero 1 && compare staged4
[ $fail = 0 ] && echo "dist.sh: all passed" || echo "dist.sh: FAILED"
exit $fail
