#!/usr/bin/env bash
# tests/gpu/e2e.sh — the driver end to end on a GPU machine: `tinymoe train`, `eval` and `sample`
# with --device cuda against the CPU. Called at the end of tests/gpu/run.sh (which builds with
# CUDA=1 BLAS=0); runs on its own too (it builds build/tinymoe when missing):
#
#   bash tests/gpu/e2e.sh          (from anywhere; the log goes to $OUT/e2e.log)
#
# On a token file made here from generated text (word salad in a play's layout, written by awk:
# the repository needs no outside data), with `--preset shakespeare` (1.8M parameters, batch
# 16 x 128 bytes) for E2E_STEPS (200) steps, the same seed everywhere:
#   a) f32 on the CPU and f32 on CUDA: the per-step training losses (metrics.jsonl) agree within
#      E2E_LOSS_RTOL (1e-4) relative over all STEPS steps, checked along the CPU's trajectory:
#      the CUDA run resumes from each of the CPU run's checkpoints (every 5 steps) and trains 5
#      steps (exit_interval 5), which must match the CPU's next 5 steps; steps 1-5 are the free
#      runs' own. The two free-running trajectories are compared too, for the first E2E_FREE
#      (25) steps. Beyond those they part by chaos, not error: two f32 runs whose GEMMs round
#      differently (the CPU with OpenBLAS and with the builtin GEMM do it too) agree to 1e-7 up to
#      step 30 and drift apart past 1e-4 by step 40, once a routing decision near a tie flips at
#      the peak learning rate (docs/cuda.md); the worst free-running difference is printed.
#   b) bf16 on CUDA: its final validation loss is within E2E_BF16_TOL (2%) of the CUDA f32 run's.
#   c) f32 on CUDA a second time: the same loss and gradient-norm sequence, bit for bit.
#   d) the CUDA run's checkpoint evaluated by `tinymoe eval` on CUDA and on the CPU (same loss
#      within 1e-4 relative), the CPU run's checkpoint likewise (checkpoints are logical
#      tensors: either device loads either file), and `tinymoe sample --device cuda` from it;
#      the CUDA run's end-of-training sample is checked in its log.
#   e) a PASS/FAIL line per check and a summary; the exit status is non-zero on any failure.
# Work files (token files, run directories with ~20 MB checkpoints) go to $E2E_DIR
# (/tmp/tinymoe-e2e), the logs of every command to $OUT. Plain shell and awk: nothing else.
# E2E_GPU_DEVICE=cpu runs every "CUDA" step on the CPU instead: a dry run of the script itself on
# a machine without a GPU (E2E_STEPS=60 keeps it short; the preset warms up for 50 steps).
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tinymoe-gpu-out}
W=${E2E_DIR:-/tmp/tinymoe-e2e}
STEPS=${E2E_STEPS:-200}
LOSS_RTOL=${E2E_LOSS_RTOL:-1e-4}
FREE=${E2E_FREE:-25}
BF16_TOL=${E2E_BF16_TOL:-0.02}
EVAL_RTOL=1e-4
SEED=1234
BIN=build/tinymoe
GPU=${E2E_GPU_DEVICE:-cuda}
mkdir -p "$OUT"
LOG="$OUT/e2e.log"
: >"$LOG"
log() { echo "$@" | tee -a "$LOG"; }

NPASS=0
NFAIL=0
SUMMARY=""
pass() { NPASS=$((NPASS + 1)); SUMMARY="$SUMMARY\nPASS  $1"; log "PASS  $1"; }
fail() { NFAIL=$((NFAIL + 1)); SUMMARY="$SUMMARY\nFAIL  $1"; log "FAIL  $1"; }
finish() {
    log ""
    log "== e2e summary ($NPASS passed, $NFAIL failed, $((SECONDS - T_START)) s)"
    printf "%b\n" "$SUMMARY" | sed '/^$/d' | tee -a "$LOG"
    if [ "$NFAIL" -eq 0 ]; then log "e2e: PASS"; exit 0; fi
    log "e2e: FAIL"
    exit 1
}
T_START=$SECONDS

log "== e2e: tinymoe train / eval / sample on CUDA against the CPU ($STEPS steps, seed $SEED)"
if [ "$GPU" = cuda ] && ! nvidia-smi -L >>"$LOG" 2>&1; then
    fail "a CUDA device is visible (nvidia-smi -L failed)"
    finish
fi
if [ ! -x "$BIN" ]; then
    log "building $BIN (CUDA=1 BLAS=0)"
    ${MAKE:-make} -j16 CUDA=1 BLAS=0 "$BIN" >>"$LOG" 2>&1 || { fail "build $BIN"; finish; }
fi

# ---- data -------------------------------------------------------------------------------------
rm -rf "$W" && mkdir -p "$W"
# 256 KiB of text from a Park-Miller generator (its products stay below 2^46: exact in awk's
# doubles, so every awk writes the same bytes).
awk -v bytes=262144 '
function rnd(n) { s = (s * 16807) % 2147483647; return int(s / 2147483647 * n) }
BEGIN {
    s = 20240520
    nw = split("the king and queen of a to my lord thou art not that with is sweet love shall be night fair " \
               "day come hence what say good sir no yes heart death life doth hath thee thy upon fortune", w, " ")
    ns = split("ROMEO JULIET NURSE MERCUTIO FRIAR TYBALT CAPULET BENVOLIO", sp, " ")
    out = 0
    while (out < bytes) {
        text = sp[rnd(ns) + 1] ":\n"
        nl = 1 + rnd(4)
        for (l = 0; l < nl; l++) {
            n = 4 + rnd(8)
            t = ""
            for (k = 0; k < n; k++) t = t (k ? " " : "") w[rnd(nw) + 1]
            text = text toupper(substr(t, 1, 1)) substr(t, 2) (rnd(3) ? "," : ".") "\n"
        }
        text = text "\n"
        printf "%s", text
        out += length(text)
    }
}' >"$W/text.txt"
if ! "$BIN" tokenize "$W/text.txt" "$W/tok.bin" --val-fraction 0.1 >>"$LOG" 2>&1; then
    fail "tinymoe tokenize"
    finish
fi

# ---- helpers ------------------------------------------------------------------------------------

# "step loss grad_norm" of every train record of a run directory's metrics.jsonl.
losses() {
    awk '
    function field(line, key,   re) {
        re = "\"" key "\": [^,}]*"
        if (!match(line, re)) return ""
        return substr(line, RSTART + length(key) + 4, RLENGTH - length(key) - 4)
    }
    /"type": "train"/ { print field($0, "step"), field($0, "loss"), field($0, "grad_norm") }' "$1/metrics.jsonl"
}
# The val_loss of the last eval record.
val_loss() {
    awk '/"type": "eval"/ { if (match($0, /"val_loss": [^,}]*/)) v = substr($0, RSTART + 12, RLENGTH - 12) }
         END { print v }' "$1/metrics.jsonl"
}
# The loss printed by `tinymoe eval` ("loss X nats/token, ...").
eval_loss() { awk '/^loss [0-9.eE+-]+ nats\/token/ { print $2 }' "$1"; }
# |a - b| / |b| <= tol ? 0 : 1; prints the relative difference.
rel_within() {
    awk -v a="$1" -v b="$2" -v tol="$3" 'BEGIN {
        if (a == "" || b == "") { print "n/a"; exit 1 }
        d = a - b; if (d < 0) d = -d; m = b < 0 ? -b : b
        r = m > 0 ? d / m : d; printf "%.3g", r; exit !(r <= tol) }'
}

COMMON=(--preset shakespeare --data "$W/tok.bin" --val_data "$W/tok_val.bin" --steps "$STEPS" --log_every 1
    --eval_every 0 --eval_batches 4 --sample_tokens 100 --seed "$SEED")
# train NAME DEVICE DTYPE: a run into $W/NAME, its log in $OUT/e2e_train_NAME.log; 0 on success.
train() {
    local name=$1 dev=$2 dt=$3 t0=$SECONDS
    shift 3
    "$BIN" train "${COMMON[@]}" --device "$dev" --dtype "$dt" --out "$W/$name" "$@" >"$OUT/e2e_train_$name.log" 2>&1
    local rc=$?
    log "   train $name ($dev, $dt): exit $rc, $((SECONDS - t0)) s; $(grep -E '^(done|memory)' "$OUT/e2e_train_$name.log" | tr '\n' ' ')"
    if [ $rc -ne 0 ]; then tail -5 "$OUT/e2e_train_$name.log" | sed 's/^/     | /' | tee -a "$LOG"; return 1; fi
    if [ "$(losses "$W/$name" | wc -l)" -ne "$STEPS" ]; then log "   $name: metrics.jsonl lacks train records"; return 1; fi
    return 0
}

# ---- runs -----------------------------------------------------------------------------------------
log "== runs"
train cpu_f32 cpu f32 --save_every 5 --keep_last 0 && OK_CPU=1 || OK_CPU=0
train cuda_f32 "$GPU" f32 && OK_CUDA=1 || OK_CUDA=0
train cuda_f32_again "$GPU" f32 && OK_AGAIN=1 || OK_AGAIN=0
train cuda_bf16 "$GPU" bf16 && OK_BF16=1 || OK_BF16=0
[ $OK_CPU = 1 ] && pass "train --device cpu (f32)" || fail "train --device cpu (f32): see $OUT/e2e_train_cpu_f32.log"
[ $OK_CUDA = 1 ] && pass "train --device cuda (f32)" || fail "train --device cuda (f32): see $OUT/e2e_train_cuda_f32.log"
[ $OK_AGAIN = 1 ] && pass "train --device cuda (f32), again" ||
    fail "train --device cuda (f32), again: see $OUT/e2e_train_cuda_f32_again.log"
[ $OK_BF16 = 1 ] && pass "train --device cuda --dtype bf16" ||
    fail "train --device cuda --dtype bf16: see $OUT/e2e_train_cuda_bf16.log"

# ---- a) CPU f32 vs CUDA f32, step by step --------------------------------------------------------
# compare A B FROM TO: the losses of steps [FROM, TO] of the "step loss grad_norm" files A (the
# reference) and B; prints "worst at n over" and succeeds when every step is within LOSS_RTOL.
compare() {
    awk -v tol="$LOSS_RTOL" -v lo="$3" -v hi="$4" '
        NR == FNR { ref[$1] = $2; next }
        $1 >= lo && $1 <= hi && ($1 in ref) {
          d = $2 - ref[$1]; if (d < 0) d = -d; r = d / (ref[$1] < 0 ? -ref[$1] : ref[$1])
          if (r > worst || n == 0) { worst = r; at = $1 }
          if (r > tol && !over) over = $1
          n++ }
        END { printf "%.3e %d %d %d\n", worst, at, n, over; exit !(n == hi - lo + 1 && worst <= tol) }' "$1" "$2"
}
log "== a) per-step training loss, CUDA f32 vs CPU f32 (rtol $LOSS_RTOL)"
if [ $OK_CPU = 1 ] && [ $OK_CUDA = 1 ]; then
    losses "$W/cpu_f32" >"$W/losses_cpu.txt"
    losses "$W/cuda_f32" >"$W/losses_cuda.txt"
    # Along the CPU trajectory: steps 1-5 from the free runs, then 5-step CUDA replays.
    read -r worst at n over <<<"$(compare "$W/losses_cpu.txt" "$W/losses_cuda.txt" 1 5)"
    replay_ok=$([ "$over" = 0 ] && [ "$n" = 5 ] && echo 1 || echo 0)
    rworst=$worst rat=$at rsteps=$n rover=$over
    for ((s = 5; s < STEPS; s += 5)); do
        ck=$(printf "%s/cpu_f32/ckpt-%08d.tmck" "$W" "$s")
        last=$((s + 5 < STEPS ? s + 5 : STEPS))
        rm -rf "$W/replay"
        if ! "$BIN" train --resume "$ck" --device "$GPU" --exit_interval 5 --out "$W/replay" \
            >"$W/replay.log" 2>&1; then
            log "   replay from $ck failed:"; tail -3 "$W/replay.log" | sed 's/^/     | /' | tee -a "$LOG"
            replay_ok=0
            continue
        fi
        losses "$W/replay" >"$W/losses_replay.txt"
        read -r worst at n over <<<"$(compare "$W/losses_cpu.txt" "$W/losses_replay.txt" $((s + 1)) "$last")"
        log "   replay of steps $((s + 1))-$last on $GPU from the CPU's step-$s checkpoint: worst rel $worst (step $at)"
        rsteps=$((rsteps + n))
        awk -v a="$worst" -v b="$rworst" 'BEGIN { exit !(a > b) }' && { rworst=$worst; rat=$at; }
        [ "$over" != 0 ] && [ "$rover" = 0 ] && rover=$over
        [ "$over" = 0 ] && [ "$n" = $((last - s)) ] || replay_ok=0
    done
    msg="a) CUDA f32 along the CPU f32 trajectory: $rsteps of $STEPS steps, worst relative difference $rworst at step $rat (limit $LOSS_RTOL)"
    [ "$rover" != 0 ] && msg="$msg; first over the limit at step $rover"
    [ "$replay_ok" = 1 ] && [ "$rsteps" = "$STEPS" ] && pass "$msg" || fail "$msg"

    # Free-running: the table, the first FREE steps checked, the rest reported.
    awk 'NR == FNR { ref[$1] = $2; next }
         ($1 % 20 == 0 || $1 == 1 || $1 == 30) && ($1 in ref) {
           d = $2 - ref[$1]; if (d < 0) d = -d
           printf "   free-running step %4d  cpu %.8f  cuda %.8f  rel %.2e\n", $1, ref[$1], $2, d / ref[$1] }' \
        "$W/losses_cpu.txt" "$W/losses_cuda.txt" | tee -a "$LOG"
    read -r worst at n over <<<"$(compare "$W/losses_cpu.txt" "$W/losses_cuda.txt" 1 "$FREE")"
    msg="a) CUDA vs CPU f32, free-running, steps 1-$FREE: worst relative difference $worst at step $at (limit $LOSS_RTOL)"
    [ "$over" = 0 ] && [ "$n" = "$FREE" ] && pass "$msg" || fail "$msg"
    read -r worst at n over <<<"$(compare "$W/losses_cpu.txt" "$W/losses_cuda.txt" 1 "$STEPS")"
    log "   free-running over all $n steps (reported, not checked): worst relative difference $worst at step $at; first over $LOSS_RTOL at step $over"
else
    fail "a) CUDA vs CPU f32 losses: a run failed"
fi

# ---- b) bf16 vs f32 on CUDA, final validation loss ----------------------------------------------
log "== b) final validation loss, CUDA bf16 vs CUDA f32 (within $BF16_TOL relative)"
if [ $OK_CUDA = 1 ] && [ $OK_BF16 = 1 ]; then
    vf=$(val_loss "$W/cuda_f32")
    vb=$(val_loss "$W/cuda_bf16")
    r=$(rel_within "$vb" "$vf" "$BF16_TOL")
    ok=$?
    msg="b) val loss bf16 $vb vs f32 $vf: relative difference $r (limit $BF16_TOL)"
    [ $ok -eq 0 ] && pass "$msg" || fail "$msg"
else
    fail "b) bf16 vs f32 val loss: a run failed"
fi

# ---- c) determinism on CUDA ---------------------------------------------------------------------
log "== c) two CUDA f32 runs with one seed: identical loss and grad-norm sequences"
if [ $OK_CUDA = 1 ] && [ $OK_AGAIN = 1 ]; then
    losses "$W/cuda_f32_again" >"$W/losses_cuda_again.txt"
    if cmp -s "$W/losses_cuda.txt" "$W/losses_cuda_again.txt"; then
        pass "c) CUDA f32 twice: $(wc -l <"$W/losses_cuda.txt") steps bit-identical (loss and grad_norm)"
    else
        first=$(diff "$W/losses_cuda.txt" "$W/losses_cuda_again.txt" | grep -m1 '^<' | cut -c3-)
        fail "c) CUDA f32 twice: sequences differ, first at (step loss grad_norm) $first"
    fi
    vf2=$(val_loss "$W/cuda_f32_again")
    [ "$vf2" = "$(val_loss "$W/cuda_f32")" ] && pass "c) CUDA f32 twice: same final val loss $vf2" ||
        fail "c) CUDA f32 twice: final val loss $vf2 vs $(val_loss "$W/cuda_f32")"
else
    fail "c) determinism: a run failed"
fi

# ---- d) checkpoints across devices, eval and sample ---------------------------------------------
log "== d) tinymoe eval / sample of the checkpoints"
# evals RUN: the run's checkpoint evaluated on CUDA and on the CPU (same windows as training's eval)
evals() {
    local run=$1 d rc
    for d in "$GPU" cpu; do
        "$BIN" eval --ckpt "$W/$run" --device "$d" --data "$W/tok_val.bin" --eval_batches 4 \
            >"$OUT/e2e_eval_${run}_$d.log" 2>&1
        rc=$?
        log "   eval $run --device $d: exit $rc; $(grep -E '^loss' "$OUT/e2e_eval_${run}_$d.log")"
    done
    local lc lh tr
    lc=$(eval_loss "$OUT/e2e_eval_${run}_$GPU.log")
    lh=$(eval_loss "$OUT/e2e_eval_${run}_cpu.log")
    tr=$(val_loss "$W/$run")
    r=$(rel_within "$lc" "$lh" "$EVAL_RTOL")
    ok=$?
    msg="d) $run checkpoint: eval --device cuda $lc vs --device cpu $lh, relative difference $r (limit $EVAL_RTOL; the run's own final val loss $tr)"
    [ $ok -eq 0 ] && pass "$msg" || fail "$msg"
}
if [ $OK_CUDA = 1 ]; then evals cuda_f32; else fail "d) eval of the CUDA checkpoint: the CUDA run failed"; fi
if [ $OK_CPU = 1 ]; then evals cpu_f32; else fail "d) eval of the CPU checkpoint: the CPU run failed"; fi
if [ $OK_CUDA = 1 ]; then
    "$BIN" sample --ckpt "$W/cuda_f32" --device "$GPU" --prompt "ROMEO:" --tokens 200 --seed 7 \
        >"$OUT/e2e_sample.txt" 2>"$OUT/e2e_sample.err"
    rc=$?
    sed 's/^/     | /' "$OUT/e2e_sample.txt" | head -20 | tee -a "$LOG"
    log "   $(tail -1 "$OUT/e2e_sample.err")"
    nbytes=$(wc -c <"$OUT/e2e_sample.txt")
    [ $rc -eq 0 ] && [ "$nbytes" -gt 8 ] && pass "d) sample --device cuda: exit 0, $nbytes bytes" ||
        fail "d) sample --device cuda: exit $rc, $nbytes bytes (see $OUT/e2e_sample.err)"
    if grep -q '^sample (temperature' "$OUT/e2e_train_cuda_f32.log"; then
        pass "d) end-of-training sample of the CUDA run"
    else
        fail "d) end-of-training sample of the CUDA run: missing from $OUT/e2e_train_cuda_f32.log"
    fi
else
    fail "d) sample --device cuda: the CUDA run failed"
fi

finish
