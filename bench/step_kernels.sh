#!/usr/bin/env bash
# step_kernels.sh — where one training step's GPU time goes: `tinymoe train` under Nsight Compute
# (ncu), every kernel's duration, summed per kernel family and per kernel over one whole step
# (bench/step_kernels.py says how the step is found and what the figures mean).
#
#   bench/step_kernels.sh [--preset coarse] [--steps 3] [--top 40] [--launches 7000] [--no-build]
#                         [-- more tinymoe train arguments]
#   bench/step_kernels.sh --self-test      (the aggregation on a made-up CSV; no GPU, no ncu)
#
# Runs `tinymoe train --preset P --device cuda --dtype bf16 --synthetic_vocab 1024 --seed 1 --out=
# --steps S` under `ncu --clock-control none --metrics gpu__time_duration.sum` (one metric: a
# single pass per kernel, no replay) for the first --launches kernel launches, which must cover
# two optimizer steps (coarse makes about 1200 launches a step, fine 840). ncu serialises the
# kernels, so a run takes minutes: coarse about 160 s for 3 steps on an H100 host. The clocks
# are left alone (METHOD.md of the GPU machines: --clock-control none). The CSV and the report go
# to $OUT/step_kernels/ (OUT defaults to /tmp/tinymoe-bench). PYTHON names the interpreter.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

preset=coarse steps=3 top=40 launches=7000 build=1
PYTHON=${PYTHON:-python3}
while [ $# -gt 0 ]; do
    case "$1" in
    --preset|--steps|--top|--launches)
        [ $# -ge 2 ] || { echo "step_kernels.sh: $1 needs a value" >&2; exit 2; }
        eval "${1#--}=\$2"
        shift 2 ;;
    --no-build) build=0; shift ;;
    --self-test) exec "$PYTHON" bench/step_kernels.py --self-test ;;
    --) shift; break ;;
    -h|--help) sed -n '2,17s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "step_kernels.sh: unknown option '$1' (--help lists them)" >&2; exit 2 ;;
    esac
done
command -v ncu >/dev/null 2>&1 || { echo "step_kernels.sh: ncu (Nsight Compute) is not on PATH" >&2; exit 3; }
OUTDIR=${OUT:-/tmp/tinymoe-bench}/step_kernels
mkdir -p "$OUTDIR"
BIN=build/tinymoe
if [ "$build" = 1 ] && [ ! -x "$BIN" ]; then
    ${MAKE:-make} -j"$(nproc)" "$BIN" >"$OUTDIR/build.log" 2>&1 || { echo "step_kernels.sh: building $BIN failed ($OUTDIR/build.log)" >&2; exit 1; }
fi
[ -x "$BIN" ] || { echo "step_kernels.sh: $BIN is missing (make $BIN)" >&2; exit 1; }
CSV="$OUTDIR/$preset.csv"
ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base --launch-count "$launches" \
    "$BIN" train --preset "$preset" --device cuda --dtype bf16 --synthetic_vocab 1024 --seed 1 --log_every 1 \
    --eval_every 0 --sample_tokens 0 --out= --steps "$steps" "$@" >"$CSV" 2>"$OUTDIR/$preset.err"
rc=$?
[ $rc = 0 ] || { echo "step_kernels.sh: ncu exited with $rc ($OUTDIR/$preset.err)" >&2; tail -5 "$OUTDIR/$preset.err" >&2; exit 1; }
"$PYTHON" bench/step_kernels.py "$CSV" --top "$top" | tee "$OUTDIR/$preset.txt"
