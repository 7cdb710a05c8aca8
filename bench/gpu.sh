#!/usr/bin/env bash
# gpu.sh — every GPU benchmark of issue 12 in one command, tinymoe beside PyTorch in the same run,
# with the tables (docs/PERFORMANCE.md explains each one and its formulas):
#
#   bash bench/gpu.sh [--quick] [--only moe,kernels,attention,train] [--no-build] [--smoke]
#   make bench-gpu BENCH_ARGS=--quick
#
#   moe        the MoE layer fwd and fwd+bwd, bf16, T=16384 H=2048 F=1408 E=64 k=6:
#              bench/moe_layer.c (the library's default grouped GEMM, and cuBLASLt per group)
#              vs bench/moe_layer_torch.py (eager, torch.compile)
#   kernels    grouped GEMM TFLOP/s vs one dense GEMM of the same FLOPs (the default, a
#              cuBLASLt GEMM per group; --gmm device, the device-scheduled tensor-core
#              kernel; --gmm hopper, its sm_90a wgmma + TMA version); permute / unpermute
#              GB/s vs a device-to-device copy: bench/kernels.c
#   attention  causal GQA attention fwd and fwd+bwd, B=16 S=1024 Hq=12 Hkv=4, D=64 and D=128:
#              bench/attention.c vs bench/attention_torch.py (SDPA)
#   train      tokens/s and MFU of the coarse and fine presets: bench/train_gpu.sh
#
# Sized for about 5 minutes on an H100, torch.compile's compilations included (not yet timed
# there); --quick: fewer iterations and no torch.compile of the training models. --smoke: a dry run
# of the whole script on the CPU with toy shapes (no GPU needed; the figures mean nothing).
# Builds build/tinymoe and the bench programs first (CUDA=1 BLAS=0, as tests/gpu/run.sh does,
# with make and cJSON from .deps/ when the machine lacks them) unless --no-build.
# Every program prints RESULT lines; all of them are collected in $OUT/bench/results.txt and the
# logs of each program in $OUT/bench/ (OUT defaults to /tmp/tinymoe-gpu-out). PYTHON selects the
# interpreter with PyTorch (default python3). Exit status 1 when any program failed (the other
# sections still run).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

quick=0 smoke=0 build=1 only=moe,kernels,attention,train
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) quick=1; shift ;;
    --smoke) smoke=1; shift ;;
    --no-build) build=0; shift ;;
    --only)
        [ $# -ge 2 ] || { echo "gpu.sh: --only needs a value" >&2; exit 2; }
        only=$2
        shift 2 ;;
    -h|--help) sed -n '2,28s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown option '$1' (--quick, --only LIST, --no-build, --smoke)" >&2; exit 2 ;;
    esac
done
export OUT=${OUT:-/tmp/tinymoe-gpu-out}
D="$OUT/bench"
mkdir -p "$D"
RES="$D/results.txt"
: >"$RES"
PYTHON=${PYTHON:-python3}
export PYTHON
T_START=$SECONDS
rc=0
has() { case ",$1," in *",$2,"*) return 0 ;; esac; return 1; }
field() { printf '%s\n' "$2" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
# pick KEY=VALUE... : the RESULT lines of $RES having every KEY=VALUE (the first one)
pick() {
    awk -v want="$*" 'BEGIN { n = split(want, w, " ") }
        { ok = 1; for (i = 1; i <= n; i++) if (index(" " $0 " ", " " w[i] " ") == 0) ok = 0; if (ok) { print; exit } }' "$RES"
}
div() { awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b == 0) print "-"; else printf "%.2f", a / b }'; }
# run NAME CMD...: run, log to $D/NAME.log, keep its RESULT lines, show its human lines
run() {
    local name=$1
    shift
    echo "\$ $*" >"$D/$name.log"
    "$@" >>"$D/$name.log" 2>&1
    local st=$?
    grep '^RESULT ' "$D/$name.log" >>"$RES"
    if [ $st -ne 0 ]; then
        echo "gpu.sh: $name failed (exit $st): $*" >&2
        grep -v '^RESULT ' "$D/$name.log" | tail -4 | sed 's/^/    /' >&2
        rc=1
    fi
    return $st
}

if [ "$smoke" = 1 ]; then
    DEV=cpu
    MOE="--T 256 --H 64 --F 48 --E 16 --k 4"
    KER="--T 256 --H 64 --F 48 --E 16 --k 4 --threads 2"
    ATT="--B 2 --S 64 --Hq 4 --Hkv 2"
    HEADS=(16 32)
else
    DEV=cuda
    MOE="" KER="" ATT=""
    HEADS=(64 128)
fi
if [ "$quick" = 1 ]; then
    MOE_IT="--warmup 2 --iters 5" KER_IT="--warmup 2 --iters 5 --block 5" ATT_IT="--warmup 3 --iters 10"
    TRAIN_ARGS="--quick"
else
    MOE_IT="--warmup 3 --iters 20" KER_IT="--warmup 3 --iters 20 --block 5" ATT_IT="--warmup 5 --iters 50"
    TRAIN_ARGS=""
fi
[ "$smoke" = 1 ] && MOE_IT="--warmup 1 --iters 2" KER_IT="--warmup 1 --iters 2 --block 2" \
    ATT_IT="--warmup 1 --iters 2" TRAIN_ARGS="--smoke --warmup 1 --steps 2 --impls tinymoe,eager"

echo "== tinymoe GPU benchmarks ($(date -u '+%Y-%m-%d %H:%M UTC'); logs in $D)"
if [ "$DEV" = cuda ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
fi
"$PYTHON" -c 'import torch; print("pytorch:", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1

# ---- build -----------------------------------------------------------------------------------
BINS="build/tinymoe build/bench/moe_layer build/bench/kernels build/bench/attention"
if [ "$build" = 1 ]; then
    MAKE="make"
    if [ "$DEV" = cuda ]; then
        # As tests/gpu/run.sh: make, cJSON, PCRE2 and utf8proc from the .debs in .deps/ when the
        # machine lacks them.
        if { ! command -v make >/dev/null 2>&1 || ! pkg-config --exists libcjson 2>/dev/null ||
             ! pkg-config --exists libpcre2-8 2>/dev/null || ! pkg-config --exists libutf8proc 2>/dev/null; } &&
           [ -d .deps ]; then
            P=/tmp/tinymoe-bench-deps
            rm -rf "$P" && mkdir -p "$P"
            for f in .deps/*.deb; do dpkg -x "$f" "$P"; done
            for d in "$P/usr/lib/x86_64-linux-gnu" "$P/lib/x86_64-linux-gnu"; do
                [ -d "$d" ] || continue
                for so in "$d"/lib*.so.*; do
                    [ -e "$so" ] || continue
                    n=$(basename "$so")
                    case "$n" in libcjson*) continue ;; esac
                    if ldconfig -p | awk '{print $1}' | grep -qx "$n"; then rm -f "$so"; fi
                done
            done
            export CPATH="$P/usr/include${CPATH:+:$CPATH}"
            export LIBRARY_PATH="$P/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
            export LD_LIBRARY_PATH="$P/usr/lib/x86_64-linux-gnu:$P/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
            command -v make >/dev/null 2>&1 || MAKE="$P/usr/bin/make"
            pkg-config --exists libcjson 2>/dev/null || export CJSON_CFLAGS="-I$P/usr/include/cjson" CJSON_LIBS="-lcjson"
            pkg-config --exists libpcre2-8 2>/dev/null || export PCRE2_CFLAGS="" PCRE2_LIBS="-lpcre2-8"
            pkg-config --exists libutf8proc 2>/dev/null || export UTF8PROC_CFLAGS="" UTF8PROC_LIBS="-lutf8proc"
        fi
        FLAGS="CUDA=1 BLAS=0"
    else
        FLAGS=""
    fi
    echo "== build: $MAKE -j$(nproc) $FLAGS $BINS"
    # shellcheck disable=SC2086
    if ! $MAKE -j"$(nproc)" $FLAGS $BINS >"$D/build.log" 2>&1; then
        echo "gpu.sh: the build failed; the end of $D/build.log:" >&2
        tail -20 "$D/build.log" >&2
        exit 1
    fi
fi
for b in $BINS; do [ -x "$b" ] || { echo "gpu.sh: $b is missing (run without --no-build)" >&2; exit 1; }; done

# ---- the MoE layer ---------------------------------------------------------------------------
if has "$only" moe; then
    echo
    echo "== moe layer ($((SECONDS - T_START)) s)"
    # The library's default grouped GEMM (--gmm auto: the Hopper kernel on an sm_90, cuBLASLt per
    # group elsewhere) is what a user gets and what the target is measured on; cuBLASLt per group
    # beside it (--gmm default), as the tables before 2026-11-28 measured the layer.
    # shellcheck disable=SC2086
    run moe_tinymoe build/bench/moe_layer --device $DEV $MOE $MOE_IT --gmm auto
    # shellcheck disable=SC2086
    run moe_tinymoe_cublaslt build/bench/moe_layer --device $DEV $MOE $MOE_IT --gmm default
    # shellcheck disable=SC2086
    run moe_torch "$PYTHON" bench/moe_layer_torch.py --device $DEV $MOE $MOE_IT --impls eager,compile
    tm=$(pick bench=moe_layer impl=tinymoe gmm=auto)
    l=$tm
    [ -n "$l" ] && echo "shape: T=$(field T "$l") H=$(field H "$l") F=$(field F "$l") E=$(field E "$l") k=$(field k "$l")," \
        "bf16; TFLOP/s of the expert GEMMs (fwd 6 T k H F, fwd+bwd 18 T k H F)"
    printf '%-16s %10s %9s %12s %9s %9s %18s\n' impl "fwd ms" TFLOP/s "fwd+bwd ms" TFLOP/s max_load "tinymoe speed-up"
    for impl in tinymoe tinymoe_cublaslt torch_eager torch_compile; do
        case $impl in
        tinymoe) l=$tm ;;
        tinymoe_cublaslt) l=$(pick bench=moe_layer impl=tinymoe gmm=default) ;;
        *) l=$(pick bench=moe_layer impl=$impl) ;;
        esac
        [ -n "$l" ] || { printf '%-16s %10s\n' "$impl" "(no result)"; continue; }
        printf '%-16s %10.3f %9.1f %12.3f %9.1f %9s %18s\n' "$impl" "$(field ms_fwd "$l")" "$(field tflops_fwd "$l")" \
            "$(field ms_fwdbwd "$l")" "$(field tflops_fwdbwd "$l")" "$(field max_load "$l")" \
            "$(div "$(field ms_fwdbwd "$l")" "$(field ms_fwdbwd "$tm")")"
    done
    echo "(speed-up: this row's fwd+bwd time over tinymoe's; target >= 1.5 against torch_compile)"
fi

# ---- kernels ---------------------------------------------------------------------------------
if has "$only" kernels; then
    echo
    echo "== kernels ($((SECONDS - T_START)) s)"
    # shellcheck disable=SC2086
    run kernels build/bench/kernels --device $DEV $KER $KER_IT
    # The device-scheduled kernels (no host group sizes): each --gmm value this build of the
    # program knows (device; hopper: the sm_90a kernel, which falls back to device elsewhere).
    variants=""
    for v in device hopper; do
        if build/bench/kernels --help 2>/dev/null | grep -q -- "--gmm.*$v"; then
            variants="$variants $v"
            # shellcheck disable=SC2086
            run kernels_gmm_$v build/bench/kernels --device $DEV $KER $KER_IT --what gemm --gmm $v
        fi
    done
    echo "grouped GEMM: TFLOP/s (2 R K N fwd, 6 R K N fwd+bwd) and % of the dense GEMM of the same FLOPs (target >= 75%)"
    printf '%-8s %-9s %8s %8s %14s' gemm routing "dense" "dense" "grouped"
    for v in $variants; do printf ' %14s' "grouped"; done
    printf ' %14s' "grouped"
    for v in $variants; do printf ' %14s' "grouped"; done
    printf '\n%-8s %-9s %8s %8s %14s' "" "" "fwd" "fwd+bwd" "fwd"
    for v in $variants; do printf ' %14s' "fwd $v"; done
    printf ' %14s' "fwd+bwd"
    for v in $variants; do printf ' %14s' "f+b $v"; done
    printf '\n'
    cell() { [ -n "$1" ] && printf ' %7.1f %5.1f%%' "$(field "tflops_$2" "$1")" "$(field "pct_dense_$2" "$1")" || printf ' %14s' "-"; }
    for op in gate_up down; do
        d=$(pick bench=gemm op=$op kind=dense gmm=default)
        for routing in balanced random skewed; do
            g=$(pick bench=gemm op=$op kind=grouped routing=$routing gmm=default)
            [ -n "$g" ] || continue
            printf '%-8s %-9s %8.1f %8.1f' "$op" "$routing" "$(field tflops_fwd "$d")" "$(field tflops_fwdbwd "$d")"
            for part in fwd fwdbwd; do
                cell "$g" $part
                for v in $variants; do cell "$(pick bench=gemm op=$op kind=grouped routing=$routing gmm=$v)" $part; done
            done
            printf '   (max load %s)\n' "$(field max_load "$g")"
        done
    done
    [ -n "$variants" ] || echo "(--gmm device / hopper: this build of bench/kernels has no --gmm; skipped)"
    c=$(pick bench=copy)
    echo
    echo "permute / unpermute: GB/s of the bytes each must move (docs/PERFORMANCE.md) and % of a D2D copy (target >= 80%)"
    echo "(bwd: the op's backward, without the harness's copy of the seed gradient; permute_topk: the layer's dispatch)"
    printf '%-12s %9s %9s %8s %9s %9s %8s %8s\n' op "fwd ms" "GB/s" "of copy" "bwd ms" "GB/s" "of copy" "syncs"
    [ -n "$c" ] && printf '%-12s %9.3f %9.1f %8s   (%s bytes, read + written)\n' "d2d copy" "$(field ms "$c")" "$(field gbs "$c")" "" "$(field bytes "$c")"
    for op in permute permute_topk unpermute; do
        l=$(pick bench=permute op=$op)
        [ -n "$l" ] || continue
        printf '%-12s %9.3f %9.1f %7.1f%% %9.3f %9.1f %7.1f%% %8s\n' "$op" "$(field ms_fwd "$l")" "$(field gbs_fwd "$l")" \
            "$(field pct_copy_fwd "$l")" "$(field ms_bwd "$l")" "$(field gbs_bwd "$l")" "$(field pct_copy_bwd "$l")" \
            "$(field syncs_fwd "$l")"
    done
fi

# ---- attention -------------------------------------------------------------------------------
if has "$only" attention; then
    echo
    echo "== attention ($((SECONDS - T_START)) s)"
    for hd in "${HEADS[@]}"; do
        # shellcheck disable=SC2086
        run attention_tinymoe_d$hd build/bench/attention --device $DEV $ATT --D "$hd" $ATT_IT
        # shellcheck disable=SC2086
        run attention_torch_d$hd "$PYTHON" bench/attention_torch.py --device $DEV $ATT --D "$hd" $ATT_IT
    done
    l=$(pick bench=attention impl=tinymoe)
    [ -n "$l" ] && echo "B=$(field B "$l") S=$(field S "$l") Hq=$(field Hq "$l") Hkv=$(field Hkv "$l") causal bf16;" \
        "TFLOP/s: fwd 2 B Hq S^2 D, fwd+bwd 3.5 times that"
    printf '%-4s %-12s %10s %9s %12s %9s %18s\n' D impl "fwd ms" TFLOP/s "fwd+bwd ms" TFLOP/s "tinymoe speed-up"
    for hd in "${HEADS[@]}"; do
        tm=$(pick bench=attention impl=tinymoe D="$hd")
        for impl in tinymoe sdpa_gqa sdpa_repeat; do
            l=$(pick bench=attention impl="$impl" D="$hd")
            [ -n "$l" ] || continue
            printf '%-4s %-12s %10.3f %9.1f %12.3f %9.1f %18s\n' "$hd" "$impl" "$(field ms_fwd "$l")" "$(field tflops_fwd "$l")" \
                "$(field ms_fwdbwd "$l")" "$(field tflops_fwdbwd "$l")" "$(div "$(field ms_fwdbwd "$l")" "$(field ms_fwdbwd "$tm")")"
        done
    done
    echo "(speed-up: this row's fwd+bwd time over tinymoe's; target >= 1 against the faster SDPA)"
fi

# ---- training --------------------------------------------------------------------------------
if has "$only" train; then
    echo
    echo "== training ($((SECONDS - T_START)) s)"
    # shellcheck disable=SC2086
    bash bench/train_gpu.sh --no-build $TRAIN_ARGS 2>&1 | tee "$D/train.log" | grep -v '^RESULT '
    [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
    grep '^RESULT ' "$D/train.log" >>"$RES"
fi

echo
echo "== done in $((SECONDS - T_START)) s; RESULT lines in $RES"
exit $rc
