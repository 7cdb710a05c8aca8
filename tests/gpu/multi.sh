#!/usr/bin/env bash
# tests/gpu/multi.sh — distributed training on GPUs against one GPU (issue 13's equivalence runs):
#   mpirun -np N tinymoe train --device cuda, N in {2,4} x ep_size in {1,2,N} x ep_strategy
#   alltoall|allgather|alltoall_dedup x zero {0,1,2,3}, the shakespeare preset in f32: the first 10 steps' losses must
#   equal the single-GPU run's (same global batch) within 1e-5 relative (2e-5 for data parallel
#   on 4 ranks at ZeRO-0 and ZeRO-3, and for ep 2 over allgather or alltoall_dedup on 2 ranks: summation
#   orders, measured below); a few layouts again in bf16
#   (their drift is reported, not judged); then a rank killed with SIGKILL mid-run: the job must
#   end within 60 s with a message naming the dead rank.
# On a machine with N or more GPUs each rank takes its own GPU and the collectives go through NCCL;
# with fewer, ranks share a GPU and use the host-staged MPI engine (the run header says which).
#   bash tests/gpu/multi.sh TEXT_FILE      (from the repository root; logs in $OUT, default /tmp/tinymoe-gpu-multi)
#   DEVICE=cpu bash tests/gpu/multi.sh TEXT_FILE   (the same on CPU ranks: a check of the script itself)
#   NS=2 bash tests/gpu/multi.sh TEXT_FILE         (only the 2-rank layouts, e.g. on a 2-GPU machine)
#   ZS="0 1 2 3" bash tests/gpu/multi.sh TEXT_FILE  (the ZeRO levels to run; default all four)
#   EXTRA="--overlap_chunks 4" bash tests/gpu/multi.sh TEXT_FILE  (more flags for every multi-rank
#       run, e.g. the chunked dispatch, or "--comm_overlap false"; the one-GPU references keep none)
set -u -o pipefail
cd "$(dirname "$0")/../.."
TEXT=${1:?usage: tests/gpu/multi.sh TEXT_FILE (e.g. tinyshakespeare.txt)}
OUT=${OUT:-/tmp/tinymoe-gpu-multi}
rm -rf "$OUT" && mkdir -p "$OUT"
BIN=./build/tinymoe
MPIRUN="mpirun --oversubscribe --allow-run-as-root"
./build/tinymoe tokenize "$TEXT" "$OUT/tok.bin" --val-fraction 0.1 >"$OUT/tokenize.log" 2>&1 || { echo "tokenize failed"; exit 1; }
ARGS="--preset shakespeare --data $OUT/tok.bin --val_data $OUT/tok_val.bin --steps 10 --log_every 1 --eval_every 0
      --eval_batches 1 --keep_last 1 --device ${DEVICE:-cuda} --sample_tokens 0"
fail=0
losses() { grep '"type": "train"' "$OUT/$1/metrics.jsonl" | sed 's/.*"loss": \([^,]*\),.*/\1/'; }
train() { # name, launcher..., then extra flags after --
    local name=$1; shift
    if ! timeout 300 "$@" --out "$OUT/$name" >"$OUT/$name.log" 2>&1; then
        echo "FAIL  $name: exit $?; tail of its log:"; tail -15 "$OUT/$name.log"; fail=1; return 1
    fi
}
compare() { # name, reference, limit (empty: report only)
    paste <(losses "$2") <(losses "$1") | awk -v n="$1" -v lim="$3" -v eng="$(grep -o 'collectives on [a-z-]*' "$OUT/$1.log" | head -1)" '
        { r = ($1 - $2) / $1; if (r < 0) r = -r; if (r > m) { m = r; at = NR } k++ }
        END { ok = (k == 10 && (lim == "" || m <= lim));
              printf "%s  %-28s %d steps, worst relative loss difference %.3g (step %d)%s; %s\n",
                     lim == "" ? "INFO" : (ok ? "PASS" : "FAIL"), n, k, m, at, lim == "" ? "" : " (limit " lim ")", eng;
              exit !ok }' || fail=1
}
for dt in f32 bf16; do train ref_$dt $BIN train $ARGS --dtype $dt; done
for n in ${NS:-2 4}; do
    for ep in 1 2 $n; do
        for st in alltoall allgather alltoall_dedup; do
            [ $ep = 1 ] && [ $st != alltoall ] && continue # ep_size 1: no dispatch collective
            for z in ${ZS:-0 1 2 3}; do
                name=n${n}_ep${ep}_${st}_z$z
                [ -d "$OUT/$name" ] && continue
                # Data parallel without ZeRO on 4 GPUs sums the gradients of 4 ranks by all-reduce
                # where one GPU sums them in one pass: measured on 4 x H100 (2026-11-27) its loss
                # differs by 2.1e-8 at step 1, growing through AdamW's steps to 2.9e-6 at step 9
                # and 1.09e-5 at step 10, and by 1.12e-5 at step 10 through the host-staged MPI
                # engine (another summation order, --nccl off): the summation order's rounding,
                # amplified by training, not a defect. Its limit is 2e-5 (the issue's bound).
                # ZeRO-3 reduces each layer's gradient by one ring reduce-scatter since session 12
                # (the all-reduce's first half): on 4 x H100 (2026-11-28) its losses differ by
                # 2.1e-8 at step 1, as ZeRO-0's, and by 1.13e-5 at step 10 (ZeRO-0 1.09e-5,
                # ZeRO-1 2.5e-6 in the same call): the same limit.
                # On 2 ranks, ep 2 over the all-gather and the deduplicated all-to-all sum each
                # token's weighted expert outputs split by rank (tinymoe.h, tm_ep_strategy): on 2 x
                # H200 (2026-11-28) allgather at ZeRO-0 and ZeRO-3 differs from one GPU by the same
                # figures step by step (0 at step 1, 2.77e-6 at step 9, 1.07e-5 / 1.06e-5 at step 10),
                # and by 2.06e-7 at step 10 with --grad_clip 0: the clip's factor, a function of the
                # whole gradient's norm, carries the combine's rounding into every weight. Same limit.
                lim=1e-5
                [ $ep = 1 ] && { [ $z = 0 ] || [ $z = 3 ]; } && [ $n = 4 ] && lim=2e-5
                [ $n = 2 ] && [ $ep = 2 ] && [ $st != alltoall ] && lim=2e-5
                train $name $MPIRUN -np $n $BIN train $ARGS --dtype f32 --ep_size $ep --ep_strategy $st --zero $z ${EXTRA:-} &&
                    compare $name ref_f32 $lim
            done
        done
    done
done
bf16_layouts="n4_ep4_alltoall_z1 n4_ep2_allgather_z0"
case " ${NS:-2 4} " in *" 4 "*) ;; *) bf16_layouts="n2_ep2_alltoall_z1 n2_ep2_allgather_z0" ;; esac
for name in $bf16_layouts; do
    set -- $(echo $name | tr '_' ' ')
    train ${name}_bf16 $MPIRUN -np ${1#n} $BIN train $ARGS --dtype bf16 --ep_size ${2#ep} --ep_strategy $3 --zero ${4#z} ${EXTRA:-} &&
        compare ${name}_bf16 ref_bf16 ""
done
# A rank killed mid-run.
$MPIRUN -np 2 $BIN train $ARGS --steps 1000000 --eval_every 0 --out "$OUT/kill" >"$OUT/kill.log" 2>&1 &
job=$!
for _ in $(seq 60); do grep -q '"type": "train"' "$OUT/kill/metrics.jsonl" 2>/dev/null && break; sleep 1; done
victim=$(pgrep -f "tinymoe train .*--out $OUT/kill" | sort -n | tail -1)
t0=$SECONDS
kill -9 "$victim" 2>/dev/null
wait $job; rc=$?
dt=$((SECONDS - t0))
if [ -n "$victim" ] && [ $rc != 0 ] && [ $dt -le 60 ]; then
    echo "PASS  a rank killed (pid $victim, SIGKILL): the job ended in ${dt} s, exit $rc:"
else
    echo "FAIL  a rank killed (pid ${victim:-none}): exit $rc after ${dt} s"; fail=1
fi
grep -iE "rank|signal|error" "$OUT/kill.log" | grep -v '^#\|^  ' | tail -4 | sed 's/^/      /'
[ $fail = 0 ] && echo "multi.sh: all passed" || echo "multi.sh: FAILED"
exit $fail
