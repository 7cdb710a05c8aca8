#!/bin/sh
# tests/emu/run.sh — build and run the host emulation of the tensor-core attention kernels
# (tests/emu/attention_emu.cpp; arguments go to it). Needs g++ (C++17) and glibc's ucontext.
set -e
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/tinymoe-attention-emu}
mkdir -p "$OUT"
sed -n '/^\/\* ==== tensor-core path/,/^\/\* ==== end of tensor-core path/p' kernels/cuda/attention.cu |
    sed '/^\/\* ---- PTX/,/^\/\* ---- end of PTX/d' >"$OUT/fa_kernels.inc"
g++ -std=c++17 -O1 -g -fno-strict-aliasing -Wall -Wno-unknown-pragmas -Wno-unused-function -I"$OUT" \
    tests/emu/attention_emu.cpp -o "$OUT/attention_emu"
exec "$OUT/attention_emu" "$@"
