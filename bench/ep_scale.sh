#!/usr/bin/env bash
# bench/ep_scale.sh — expert parallelism at GPU scale (issue 19): one model on 1, 2 and 4 GPUs
# with data parallelism (dp), expert parallelism over the ragged all-to-all (alltoall), over
# the all-gather (allgather) and over the deduplicated all-to-all (dedup: alltoall_dedup), weak scaling at a fixed number of tokens per GPU, in one run:
#
#   mpirun -np N tinymoe train --preset P --device cuda --dtype bf16 --synthetic_vocab 1024 \
#       --batch_size $((16 N)) --ep_size N|1 --ep_strategy alltoall|allgather|alltoall_dedup --out ''
#
#   bench/ep_scale.sh [--preset fine] [--steps 300] [--warmup 20] [--gpus "1 2 4"]
#                     [--layouts "dp alltoall allgather dedup"] [--bind "none core"] [--smoke]
#                     [--also "FLAGS"]    (every multi-GPU run again with FLAGS added, in the same call: an
#                                        A/B of a flag on one machine, e.g. "--grad_sync_overlap false";
#                                        its rows end in _also)
#                     [--extra "FLAGS"]   (more train flags for every run, e.g. "--comm_overlap false";
#                                        "--force_load_balance true" routes round robin, every expert
#                                        and rank equally loaded: the dispatch without the routing's
#                                        imbalance, for benchmarks only, docs/layouts.md)
#
# A layout may end in :zN, the ZeRO level of the run (--zero N; default 0): "dp:z3" is data
# parallelism with fully sharded weights (FSDP), "dedup:z1" the deduplicated all-to-all with
# sharded optimizer state. The 1-GPU baseline is always "dp" at ZeRO 0.
#
# Per run, one row: ms/step (mean of the steps after --warmup, from rank 0's step table), tokens/s
# per GPU and its ratio to the 1-GPU run (weak-scaling efficiency), the routing's load (the largest
# expert's rows over the mean, averaged over the same steps: E / k means every token went to the
# same k experts, which an expert-parallel layout pays for on the rank that holds them and a
# data-parallel one does not; --extra "--force_load_balance true" takes the routing out of the
# comparison), each GPU's peak memory as
# nvidia-smi saw it (sampled every 0.2 s: what the process holds, CUDA context and NCCL
# included) against the 1-GPU run's, the library's own report of rank 0 (temporaries in use at
# most, arena reserved at most), and the start-up: launch to the end of the first step minus
# that step (wall clock of the whole run minus the driver's 'done: N steps in S s' minus the
# final evaluation, i.e. everything before the first step and after the last).
# --bind: how mpirun binds ranks ("core" is Open MPI's default for 2 ranks or fewer per node;
# "none" leaves each rank every CPU of the node). Logs in $OUT (default /tmp/tinymoe-ep-scale).
# --smoke: CPU ranks and a toy model (a check of this script, no GPU).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
preset=fine steps=300 warmup=20 gpus="1 2 4" layouts="dp alltoall allgather" bind="none" smoke=0 extra_flags="" also_flags=""
while [ $# -gt 0 ]; do
    case "$1" in
    --preset|--steps|--warmup|--gpus|--layouts|--bind)
        [ $# -ge 2 ] || { echo "ep_scale.sh: $1 needs a value" >&2; exit 2; }
        eval "${1#--}=\$2"; shift 2 ;;
    --smoke) smoke=1; shift ;;
    --extra) [ $# -ge 2 ] || { echo "ep_scale.sh: --extra needs a value" >&2; exit 2; }; extra_flags=$2; shift 2 ;;
    --also) [ $# -ge 2 ] || { echo "ep_scale.sh: --also needs a value" >&2; exit 2; }; also_flags=$2; shift 2 ;;
    -h|--help) sed -n '2,32s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "ep_scale.sh: unknown option '$1'" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-/tmp/tinymoe-ep-scale}
mkdir -p "$OUT"
BIN=$PWD/build/tinymoe
[ -x "$BIN" ] || { echo "ep_scale.sh: $BIN is missing (make)" >&2; exit 1; }
if [ "$smoke" = 1 ]; then
    device=cpu dtype=f32 per_gpu=2
    extra="--preset $preset --d_model 64 --n_layers 2 --n_heads 4 --n_kv_heads 2 --expert_ffn_size 32 --vocab_size 1024
           --seq_len 64 --threads 1"
else
    device=cuda dtype=bf16 per_gpu=16
    extra="--preset $preset"
fi
MPI="mpirun --oversubscribe --allow-run-as-root"
rows=()
base_tps="" base_mem=""
for n in $gpus; do
    lays=$layouts
    [ "$n" = 1 ] && lays=dp # the baseline, whatever --layouts says
    for lay in $lays; do
        for b in $bind; do
          for v in 0 ${also_flags:+1}; do
            [ "$n" = 1 ] && [ "$b" != "${bind%% *}" ] && continue
            [ "$n" = 1 ] && [ "$v" = 1 ] && continue
            name=n${n}_${lay/:/-}_bind-$b
            vflags=""
            [ "$v" = 1 ] && name=${name}_also vflags=$also_flags
            log=$OUT/$name.log
            ep=1 st=alltoall zero=0 base=${lay%%:*}
            case "$lay" in *:z[0-3]) zero=${lay##*:z} ;; *:*) echo "ep_scale.sh: bad layout '$lay'" >&2; exit 2 ;; esac
            [ "$base" = alltoall ] && ep=$n
            [ "$base" = allgather ] && ep=$n st=allgather
            [ "$base" = dedup ] && ep=$n st=alltoall_dedup
            args="train $extra --device $device --dtype $dtype --synthetic_vocab 1024 --batch_size $((per_gpu * n))
                  --ep_size $ep --ep_strategy $st --zero $zero --steps $steps --log_every 1 --eval_every 0 --eval_batches 1
                  --sample_tokens 0 --out '' $extra_flags $vflags"
            args=$(echo $args) # one line: it goes through eval and bash -c
            smi=""
            if [ "$device" = cuda ]; then
                nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 >"$OUT/$name.smi" 2>/dev/null &
                smi=$!
            fi
            t0=$(date +%s.%N)
            rc=""
            if [ "$n" = 1 ]; then
                eval "$BIN $args" >"$log" 2>&1
                rc=$?
            else
                # Each rank writes its own file: rank 0's is the log (no terminal: the step table).
                $MPI -np "$n" --bind-to "$b" -x LD_LIBRARY_PATH bash -c "exec $BIN $args >$OUT/$name.rank\$OMPI_COMM_WORLD_RANK.log 2>&1"
                rc=$?
                cp "$OUT/$name.rank0.log" "$log"
            fi
            t1=$(date +%s.%N)
            [ -n "$smi" ] && kill "$smi" 2>/dev/null && wait "$smi" 2>/dev/null
            wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
            read -r ms train_s load <<<"$(awk -v w="$warmup" '
                $1 == "step" && !c { for (i = 1; i <= NF; i++) { if ($i == "ms/step") c = i; if ($i == "load") l = i }; next }
                c && $1 ~ /^[0-9]+$/ && $1 > w { s += $c; k++; if (l) q += $l }
                /^done: / { t = $5 }
                END { printf "%s %s %s\n", k ? s / k : "nan", t ? t : "nan", k && l ? sprintf("%.2f", q / k) : "-" }' "$log")"
            tps=$(awk -v ms="$ms" -v b="$per_gpu" 'BEGIN { if (ms == "nan") print "nan"; else printf "%.0f", b * 1024 * 1000 / ms }')
            [ "$smoke" = 1 ] && tps=$(awk -v ms="$ms" -v b="$per_gpu" 'BEGIN { if (ms == "nan") print "nan"; else printf "%.0f", b * 64 * 1000 / ms }')
            mem="-"
            if [ -s "$OUT/$name.smi" ]; then
                mem=$(awk -F', *' -v n="$n" '$1 < n && $2 > m[$1] { m[$1] = $2 } END { s = ""; for (i = 0; i < n; i++) s = s (i ? "/" : "") sprintf("%.1f", m[i] / 1024); print s }' "$OUT/$name.smi")
            fi
            lib=$(awk '/temporaries: .* in use at most/ { printf "%.1f/%.1f", $2 / 1024, $8 / 1024 }' "$log")
            start=$(awk -v w="$wall" -v t="$train_s" 'BEGIN { if (t == "nan") print "nan"; else printf "%.1f", w - t }')
            if [ "$n" = 1 ] && [ "$lay" = dp ]; then base_tps=$tps; base_mem=$(echo "$mem" | cut -d/ -f1); fi
            eff=$(awk -v a="$tps" -v b="$base_tps" 'BEGIN { if (a == "nan" || b == "" || b == "nan") print "-"; else printf "%.2f", a / b }')
            mx=$(echo "$mem" | tr '/' '\n' | sort -g | tail -1)
            memr=$(awk -v a="$mx" -v b="$base_mem" 'BEGIN { if (a == "-" || b == "" || b == "-") print "-"; else printf "%.2f", a / b }')
            status=ok
            [ "$rc" != 0 ] && status="exit $rc: $(grep -h -m1 -iE 'error|failed|out of' "$OUT/$name"*.log 2>/dev/null | head -1 | cut -c1-120)"
            rows+=("$(printf '%-26s %9s %11s %6s %6s %-23s %6s %-11s %8s  %s' "$name" "$ms" "$tps" "$eff" "$load" "$mem" "$memr" "$lib" "$start" "$status")")
            printf '%s\n' "${rows[-1]}"
          done
        done
    done
done
echo
echo "preset $preset, $dtype, $per_gpu x 1024 tokens per GPU, $steps steps (mean ms/step after $warmup)${extra_flags:+, extra flags: $extra_flags}${also_flags:+; rows _also: $also_flags added}; $(date -u '+%Y-%m-%d %H:%M UTC')"
[ "$device" = cuda ] && nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
printf '%-26s %9s %11s %6s %6s %-23s %6s %-11s %8s  %s\n' run ms/step tok/s/GPU vs1 load "peak GiB per GPU (smi)" vs1 "GiB use/res" start_s status
printf '%s\n' "${rows[@]}"
