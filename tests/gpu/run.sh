#!/usr/bin/env bash
# tests/gpu/run.sh — build tinymoe with the CUDA backend and run the whole Criterion suite on a
# GPU machine that has nvcc but no Criterion and no network.
#
#   bash tests/gpu/run.sh          (from the repository root; the log goes to $OUT/test.log)
#   make test-cuda                 (the same)
#   FILTER='cuda_parity/arena*' bash tests/gpu/run.sh   (only the tests of a Criterion glob)
#
# Ends with tests/gpu/e2e.sh: `tinymoe train / eval / sample --device cuda` against the CPU.
#
# Criterion comes from Debian bookworm .debs carried in the ignored folder .deps/ (prepared on the
# dev machine with `apt-get download`, see the end of this file). They are unpacked into a private
# prefix; only libraries the machine lacks are kept there, so nothing of the system is shadowed.
# The Makefile's link rule takes no LDFLAGS, so the compiler finds the headers and -lcriterion
# through CPATH / LIBRARY_PATH; pkg-config is left alone (criterion.pc would point at /usr).
set -u -o pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tinymoe-gpu-out}
mkdir -p "$OUT"
LOG="$OUT/test.log"
: >"$LOG"
log() { echo "$@" | tee -a "$LOG"; }

PREFIX=/tmp/tinymoe-deps
rm -rf "$PREFIX" && mkdir -p "$PREFIX"
for f in .deps/*.deb; do dpkg -x "$f" "$PREFIX" || { log "run.sh: cannot unpack $f"; exit 1; }; done
LIBDIRS="$PREFIX/usr/lib/x86_64-linux-gnu $PREFIX/lib/x86_64-linux-gnu"
for d in $LIBDIRS; do
    [ -d "$d" ] || continue
    for so in "$d"/lib*.so.*; do
        [ -e "$so" ] || continue
        name=$(basename "$so")
        case "$name" in libcriterion*|libcjson*) continue ;; esac
        # The system's copy (same soname) wins: drop ours.
        if ldconfig -p | awk '{print $1}' | grep -qx "$name"; then rm -f "$so"; fi
    done
done
export CPATH="$PREFIX/usr/include${CPATH:+:$CPATH}"
export LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LIBRARY_PATH:+:$LIBRARY_PATH}"
export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu:$PREFIX/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
MAKE=make
command -v make >/dev/null 2>&1 || MAKE="$PREFIX/usr/bin/make"
# cJSON from .deps when the machine has none (its libcjson.pc would point at /usr).
if ! pkg-config --exists libcjson 2>/dev/null; then
    export CJSON_CFLAGS="-I$PREFIX/usr/include/cjson" CJSON_LIBS="-lcjson"
fi
# PCRE2 likewise (libpcre2-dev: pcre2.h and libpcre2-8.so; the machine's own libpcre2-8.so.0,
# which most systems carry, wins at run time as above).
if ! pkg-config --exists libpcre2-8 2>/dev/null; then
    export PCRE2_CFLAGS="" PCRE2_LIBS="-lpcre2-8"
fi
# utf8proc likewise (libutf8proc-dev: utf8proc.h and libutf8proc.so; libutf8proc2's
# libutf8proc.so.2 is kept from .deps where the machine has none).
if ! pkg-config --exists libutf8proc 2>/dev/null; then
    export UTF8PROC_CFLAGS="" UTF8PROC_LIBS="-lutf8proc"
fi

{
    echo "== machine"
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvcc --version | tail -2
    cc --version | head -1
    echo "kept from .deps: $(ls $PREFIX/usr/lib/x86_64-linux-gnu $PREFIX/lib/x86_64-linux-gnu 2>/dev/null | grep '\.so\.' | tr '\n' ' ')"
} 2>&1 | tee -a "$LOG"

log "== build"
$MAKE -j16 CUDA=1 BLAS=0 2>&1 | tail -40 | tee -a "$LOG"
$MAKE -j16 CUDA=1 BLAS=0 build/tinymoe_tests 2>&1 | tail -40 | tee -a "$LOG"
[ -x build/tinymoe_tests ] || { log "run.sh: the test binary did not build"; exit 1; }
ldd build/tinymoe_tests | grep -E 'not found|criterion|cublasLt|cudart' | tee -a "$LOG"

log "== test"
rc=0
# FILTER=<criterion glob>: only those tests, verbose, and nothing after them.
if [ -n "${FILTER:-}" ]; then
    ./build/tinymoe_tests --verbose --filter="$FILTER" 2>&1 | grep -v '^\[SKIP\].*disabled' | tee -a "$LOG"
    exit "${PIPESTATUS[0]}"
fi
if [ -x build/tinymoe ]; then
    $MAKE CUDA=1 BLAS=0 test 2>&1 | tee -a "$LOG" || rc=$?
else
    log "(no driver binary: running the test binary directly, as make test would)"
    ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
        ./build/tinymoe_tests --jobs 2 2>&1 | tee -a "$LOG" || rc=$?
fi
log "== CUDA tests, verbose"
./build/tinymoe_tests --verbose --filter='cuda_parity/*' 2>&1 | grep -v '^\[SKIP\].*disabled' | tee -a "$LOG"

# The Hugging Face export against transformers' MixtralForCausalLM (docs/hf-export.md): the test
# writes exports, tokens and tinymoe's logits; hf_check.py loads them with transformers and
# compares logits on the CPU and the GPU. Outside $OUT: it brings back only a few files.
log "== Hugging Face export vs transformers"
HF_DIR=/tmp/tinymoe-hf
rm -rf "$HF_DIR"
if TM_HF_DUMP_DIR="$HF_DIR" ./build/tinymoe_tests --filter='hf/transformers_reference' 2>&1 | tee -a "$LOG"; then
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 python3 tests/gpu/hf_check.py "$HF_DIR" 2>&1 |
        tr '\r' '\n' | grep -v '^Loading weights' | tee -a "$LOG" || rc=1
else
    rc=1
fi

# transformers' text-generation pipeline on exports against `tinymoe sample` (tests/test_hf_pipeline.c).
# It needs torch, which CI does not install, so it skips without it; here the machine's python3
# has torch and transformers: TM_PYTHON names it (before the tests' own .pyenv/) and
# TM_REQUIRE_TORCH=1 makes a Python without them a failure, not a skip. (The suite above ran it
# too when python3 has torch; this run is the one that cannot skip.)
log "== transformers' text-generation pipeline (hf_pipeline, TM_REQUIRE_TORCH=1)"
py3=$(command -v python3 || echo python3)
TM_PYTHON="$py3" TM_REQUIRE_TORCH=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    ./build/tinymoe_tests --verbose --filter='hf_pipeline/*' >"$OUT/hf_pipeline.log" 2>&1
hp_rc=$?
grep -v '^\[SKIP\].*disabled' "$OUT/hf_pipeline.log" | tee -a "$LOG"
# a pass, not a skip (Criterion exits 0 on a skip)
if [ "$hp_rc" -ne 0 ] || ! grep -q '^\[PASS\] hf_pipeline::' "$OUT/hf_pipeline.log"; then
    log "run.sh: hf_pipeline did not pass (exit $hp_rc)"
    rc=1
fi

# The driver end to end: train / eval / sample on CUDA against the CPU (its own log: $OUT/e2e.log).
log "== end to end (tests/gpu/e2e.sh)"
OUT="$OUT" MAKE="$MAKE" bash tests/gpu/e2e.sh 2>&1 | tee -a "$LOG" || rc=1
exit $rc

# Preparing .deps on a Debian bookworm dev machine (x86-64), from the repository root:
#   mkdir -p .deps && cd .deps && apt-get download libcriterion3 libcriterion-dev libnanomsg5 \
#     libgit2-1.5 libffi8 libhttp-parser2.9 libmbedcrypto7 libmbedtls14 libmbedx509-1 libssh2-1 \
#     libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 make zlib1g-dev \
#     libcjson1 libcjson-dev libpcre2-8-0 libpcre2-dev libutf8proc2 libutf8proc-dev
# (about 2.6 MiB; /.deps/ is in .git/info/exclude; pass carry: [".deps"] to the device tool).
