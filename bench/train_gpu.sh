#!/usr/bin/env bash
# train_gpu.sh — training throughput and MFU of the "coarse" and "fine" presets: tinymoe against
# the same model in PyTorch (bench/train_torch.py, eager and torch.compile), one GPU, one run.
#
#   bench/train_gpu.sh [--presets coarse,fine] [--warmup N] [--steps N] [--impls LIST]
#                      [--peak TFLOPS] [--quick] [--smoke] [--no-build]
#
# tinymoe: `tinymoe train --preset P --device cuda --dtype bf16` on its synthetic source (with
# synthetic_vocab 1024: 1024 distinct token ids, so that the routing at initialisation is not
# decided by a handful of tokens; PyTorch draws tokens uniformly from the same 1024), warm-up +
# timed steps, logging every step, no evaluation until the end (one batch), no files (--out ''):
# the final checkpoint of a 0.5-0.9B-parameter model would take longer to write than the run.
# Its tokens/s: batch x seq x 1000 / the mean of the ms/step the driver logs for the timed steps
# (the figure metrics.jsonl records; the driver times each step to the end of its loss read).
# PyTorch gets the model and optimizer keys the driver printed (its resolved config), so that
# both train the same model: bench/train_torch.py says how it is written.
# MFU = tokens/s x flops_per_token / peak (--peak, default 989 TFLOP/s: H100 SXM dense bf16),
#   flops_per_token = 6 (active parameters per token - vocab_size d_model)
#                   + 12 n_layers d_model seq_len
# (PaLM appendix B, llm.c: the input embedding is a lookup and does no multiply-add, the LM head
# does and counts; attention not halved for the causal mask). Active parameters count the
# routed experts k/E (tinymoe's "active per token"). coarse: 1.058e9 FLOPs/token, fine: 8.84e8.
# --impls: tinymoe, eager, compile (default all three); --quick: 3 + 8 steps, no torch.compile;
# --smoke: a CPU dry run of this script with both presets cut to toy sizes (no GPU needed).
# PYTHON selects the interpreter (default python3). Each run prints a RESULT line; the tables
# give tinymoe's tokens/s over each PyTorch run's.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

presets=coarse,fine warmup=5 steps=20 impls=tinymoe,eager,compile peak=989 smoke=0 build=1
while [ $# -gt 0 ]; do
    case "$1" in
    --presets|--warmup|--steps|--impls|--peak)
        [ $# -ge 2 ] || { echo "train_gpu.sh: $1 needs a value" >&2; exit 2; }
        eval "${1#--}=\$2"
        shift 2 ;;
    --quick) warmup=3 steps=8 impls=tinymoe,eager; shift ;;
    --smoke) smoke=1; shift ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,30s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "train_gpu.sh: unknown option '$1'" >&2; exit 2 ;;
    esac
done
PYTHON=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp/tinymoe-bench}/train
mkdir -p "$OUTDIR"
BIN=build/tinymoe
if [ "$smoke" = 1 ]; then
    device=cpu
    # Toy widths, the presets' expert counts and top-k: a check of the plumbing, not a figure.
    extra="--d_model 64 --n_layers 2 --n_heads 4 --n_kv_heads 2 --expert_ffn_size 32 --vocab_size 2048
           --seq_len 64 --batch_size 4 --threads 2"
else
    device=cuda
    extra=""
fi
if [ "$build" = 1 ] && [ ! -x "$BIN" ]; then
    ${MAKE:-make} -j"$(nproc)" "$BIN" >"$OUTDIR/build.log" 2>&1 || { echo "train_gpu.sh: building $BIN failed ($OUTDIR/build.log)" >&2; exit 1; }
fi
[ -x "$BIN" ] || { echo "train_gpu.sh: $BIN is missing (make $BIN)" >&2; exit 1; }

has() { case ",$1," in *",$2,"*) return 0 ;; esac; return 1; }
# field NAME LINE: the value of NAME=... in a RESULT line
field() { printf '%s\n' "$2" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
# conf NAME LOG: a key's value in the config the driver printed ("name = value   # source")
conf() { awk -v k="$2" '$1 == k && $2 == "=" { print $3; exit }' "$1"; }

rc=0
for preset in $(echo "$presets" | tr ',' ' '); do
    echo "== train: preset $preset on $device ($warmup warm-up + $steps timed steps)"
    results=""
    log="$OUTDIR/tinymoe-$preset.log"
    # shellcheck disable=SC2086
    "$BIN" train --preset "$preset" --device "$device" --dtype bf16 --steps $((warmup + steps)) --log_every 1 \
        --eval_every 0 --eval_batches 1 --out '' --synthetic_vocab 1024 --seed 1 $extra >"$log" 2>&1
    st=$?
    if [ $st -ne 0 ]; then
        echo "train_gpu.sh: tinymoe train --preset $preset failed (exit $st); the end of $log:" >&2
        tail -5 "$log" >&2
        rc=1
        continue
    fi
    B=$(conf "$log" batch_size) T=$(conf "$log" seq_len) V=$(conf "$log" vocab_size)
    H=$(conf "$log" d_model) L=$(conf "$log" n_layers)
    read -r params active < <(awk '/^model : / { print $3, $5; exit }' "$log")
    if has "$impls" tinymoe; then
        # The step table: find the ms/step column in its header, average it over the timed steps.
        # The "wait ms" column (CUDA: the host's time blocked on the GPU per step) is the last.
        read -r ms wait < <(awk -v w="$warmup" '
            $1 == "step" && !c { for (i = 1; i <= NF; i++) if ($i == "ms/step") c = i; next }
            c && $1 ~ /^[0-9]+$/ && $1 > w { s += $c; q += $NF; n++ }
            END { if (n) printf "%.3f %.3f", s / n, q / n }' "$log")
        if [ -z "$ms" ]; then
            echo "train_gpu.sh: no timed steps in $log" >&2
            rc=1
        else
            line=$(awk -v B="$B" -v T="$T" -v V="$V" -v H="$H" -v L="$L" -v a="$active" -v p="$params" -v ms="$ms" \
                -v peak="$peak" -v dev="$device" -v s="$steps" -v pr="$preset" -v wt="$wait" 'BEGIN {
                fpt = 6 * (a - V * H) + 12 * L * H * T; tps = B * T * 1000 / ms
                printf "RESULT bench=train impl=tinymoe preset=%s device=%s tokens_per_s=%.1f ms_per_step=%.2f mfu=%.4f params=%d active=%d flops_per_token=%.0f batch=%d seq=%d steps=%d wait_ms=%.2f\n",
                    pr, dev, tps, ms, tps * fpt / (peak * 1e12), p, a, fpt, B, T, s, dev == "cuda" ? wt : 0 }')
            echo "$line"
            results="$line"
        fi
        # which kernels the run took (tinymoe train prints it after a CUDA run)
        grep -E '^kernels \(|off the Hopper kernel' "$log" | sed 's/^ */  /'
    fi
    timpls=""
    has "$impls" eager && timpls="eager"
    has "$impls" compile && timpls="${timpls:+$timpls,}compile"
    if [ -n "$timpls" ]; then
        args=""
        for k in vocab_size d_model n_layers n_heads n_kv_heads num_experts topk expert_ffn_size seq_len batch_size \
                 rope_theta norm_eps init_std aux_loss_coeff z_loss_coeff lr warmup_steps beta1 beta2 eps \
                 weight_decay grad_clip; do
            args="$args --$k $(conf "$log" "$k")"
        done
        tlog="$OUTDIR/torch-$preset.log"
        # shellcheck disable=SC2086
        "$PYTHON" bench/train_torch.py --device "$device" --impls "$timpls" $args --data_vocab 1024 \
            --warmup "$warmup" --steps "$steps" --peak_tflops "$peak" >"$tlog" 2>&1
        st=$?
        grep -v '^RESULT ' "$tlog" | grep -E '^pytorch|Error|error' | sed 's/^/  /'
        while IFS= read -r line; do
            line="${line/impl=/preset=$preset impl=}"
            echo "$line"
            results="$results"$'\n'"$line"
        done < <(grep '^RESULT ' "$tlog")
        if [ $st -ne 0 ]; then
            echo "train_gpu.sh: bench/train_torch.py failed (exit $st); the end of $tlog:" >&2
            tail -5 "$tlog" >&2
            rc=1
        fi
    fi
    [ -n "$results" ] || continue
    tm=$(printf '%s\n' "$results" | grep 'impl=tinymoe' | head -1)
    echo
    echo "preset $preset: $params parameters, $active active per token; MFU against $peak TFLOP/s"
    printf '%-16s %12s %10s %8s %16s\n' impl tokens/s ms/step MFU tinymoe/impl
    printf '%s\n' "$results" | sed '/^$/d' | while IFS= read -r line; do
        r=""
        if [ -n "$tm" ]; then
            r=$(awk -v a="$(field tokens_per_s "$tm")" -v b="$(field tokens_per_s "$line")" 'BEGIN { printf "%.2f", a / b }')
        fi
        printf '%-16s %12.0f %10.1f %7.1f%% %16s\n' "$(field impl "$line")" "$(field tokens_per_s "$line")" \
            "$(field ms_per_step "$line")" "$(awk -v m="$(field mfu "$line")" 'BEGIN { print 100 * m }')" "$r"
    done
    echo
done
exit $rc
