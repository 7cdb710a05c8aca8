#!/usr/bin/env bash
# tests/gpu/sanitize.sh — compute-sanitizer over the CUDA kernels on a GPU machine: memcheck
# (out-of-bounds and misaligned accesses, leaks of device memory) and racecheck (shared-memory
# hazards between the threads of a block) on the Hopper grouped GEMM's standalone harness and on
# the CUDA parity tests of the kernels most often changed. Issue 20 asks every new kernel to be
# clean under both.
#
#   bash tests/gpu/sanitize.sh [--tools memcheck,racecheck] [--filters 'glob,glob'] [--no-build]
#
# Builds like tests/gpu/run.sh (FILTER that matches nothing: the build only), then for each tool:
#   the harness `bench/gmm_sm90_harness --small` (its small cases: ragged, empty and one-row groups,
#   counts short of R, every direction; on an sm_90 device only), and
#   build/tinymoe_tests --jobs 1 --filter=GLOB for each glob (default: the grouped GEMM, dispatch,
#   update, rope/attention and indexing parity tests).
# Criterion runs each test in a child process: compute-sanitizer follows them (--target-processes
# all). A run passes when the sanitizer reports "0 errors" for every process it watched and the
# tests pass. Logs: $OUT/sanitize/<tool>_<what>.log (OUT defaults to /tmp/tinymoe-gpu-out).
# Racecheck slows kernels by 10-100x: the default filters keep a run within a few minutes.
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 2
tools=memcheck,racecheck
filters='cuda_parity_moe/grouped_matmul_bf16_hopper*,cuda_parity_grouped_swiglu/*,cuda_parity_grouped_mlp/hopper*,cuda_parity_moe/unpermute*,cuda_parity_update/*,cuda_parity_attention/*,cuda_parity_indexing/*'
build=1
while [ $# -gt 0 ]; do
    case "$1" in
    --tools|--filters)
        [ $# -ge 2 ] || { echo "sanitize.sh: $1 needs a value" >&2; exit 2; }
        eval "${1#--}=\$2"
        shift 2 ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,20s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "sanitize.sh: unknown option '$1' (--help lists them)" >&2; exit 2 ;;
    esac
done
command -v compute-sanitizer >/dev/null 2>&1 || { echo "sanitize.sh: compute-sanitizer is not on PATH" >&2; exit 3; }
OUT=${OUT:-/tmp/tinymoe-gpu-out}
LOGDIR="$OUT/sanitize"
mkdir -p "$LOGDIR"
if [ "$build" = 1 ]; then
    FILTER='no_such_test_xyz' OUT="$OUT" bash tests/gpu/run.sh >"$LOGDIR/build.log" 2>&1
    [ -x build/tinymoe_tests ] || { echo "sanitize.sh: the build failed ($LOGDIR/build.log)" >&2; exit 1; }
    make CUDA=1 BLAS=0 build/bench/gmm_sm90_harness >>"$LOGDIR/build.log" 2>&1 ||
        echo "sanitize.sh: the sm90 harness did not build (no sm_90a toolchain?): skipped" | tee -a "$LOGDIR/build.log"
fi
# The libraries tests/gpu/run.sh unpacked from .deps (Criterion) for the test binary.
PREFIX=/tmp/tinymoe-deps
export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu:$PREFIX/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

rc=0
# one <tool> <name> <command...>: the command under the tool; fails on a sanitizer error or a failing command.
# IGNORE_KERNELS (an ERE of kernel names, empty: none): hazards reported in those kernels only are not ours
# (cuBLAS's own Hopper kernels, nvjet_*, which the harness runs as its reference: racecheck reports
# hazards between their TMA writes and wgmma reads that it cannot order). compute-sanitizer's own
# --kernel-name / --kernel-name-exclude filters end those runs in "failed to handle a hardware
# exception" (CUDA 13, H200), so the filter is applied to the report instead.
IGNORE_KERNELS=''
one() {
    local tool=$1 name=$2 log="$LOGDIR/${1}_$2.log"
    shift 2
    compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 97 "$@" >"$log" 2>&1
    local r=$?
    local errs ours
    errs=$(grep -E "ERROR SUMMARY: [1-9]|RACECHECK SUMMARY: [1-9]|========= (Invalid|Race|Error)" "$log")
    ours=$errs
    if [ -n "$IGNORE_KERNELS" ]; then
        # every reported hazard is in an ignored kernel: only the summaries and those hazards remain
        ours=$(echo "$errs" | grep -vE "SUMMARY|Race reported between .* access at ($IGNORE_KERNELS)")
        # and only when the program itself succeeded: 97 replaces its exit code, so its own report
        # must say so (the harness's "CHECK all ok", Criterion's synthesis without failures)
        [ $r -eq 97 ] && [ -z "$ours" ] && grep -qE "Race reported" "$log" &&
            grep -qE "CHECK all ok|Synthesis: .*Failing: 0 \| Crashing: 0" "$log" && r=0
    fi
    if [ $r -ne 0 ] || [ -n "$ours" ]; then
        echo "FAIL $tool $name (exit $r): $(echo "${ours:-$errs}" | head -3)"
        rc=1
    else
        local nign=0
        [ -n "$IGNORE_KERNELS" ] && nign=$(grep -cE "Race reported between .* access at ($IGNORE_KERNELS)" "$log")
        if [ "$nign" -gt 0 ]; then
            echo "PASS $tool $name (no hazard in our kernels; $nign reported in $IGNORE_KERNELS kernels, not ours, ignored)"
        else
            echo "PASS $tool $name ($(grep -cE 'ERROR SUMMARY: 0|RACECHECK SUMMARY: 0' "$log") processes clean)"
        fi
    fi
}
IFS=, read -r -a TOOLS <<<"$tools"
IFS=, read -r -a GLOBS <<<"$filters"
for tool in "${TOOLS[@]}"; do
    if [ -x build/bench/gmm_sm90_harness ] && nvidia-smi --query-gpu=compute_cap --format=csv,noheader | grep -q '^9\.0'; then
        IGNORE_KERNELS='nvjet_' one "$tool" gmm_sm90_harness build/bench/gmm_sm90_harness --small
    fi
    for g in "${GLOBS[@]}"; do
        one "$tool" "$(echo "$g" | tr -c 'A-Za-z0-9_\n' '_')" build/tinymoe_tests --jobs 1 --filter="$g"
    done
done
exit $rc
