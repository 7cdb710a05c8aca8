#!/bin/sh
# check-exports.sh — libtinymoe.so exports the public API and nothing else.
#
#   scripts/check-exports.sh build/libtinymoe.so build/libtinymoe.a
#
# The public API is every global tm_<name> function of the archive (tm__ names are private):
# each must be exported by the shared library (a function missing TM_API in include/tinymoe.h
# is not), and the shared library may export nothing else: no tm__ symbol, no other name. The
# exceptions are symbols that the linker or a sanitizer runtime adds by itself (listed below).
# Run by `make test`; exits 1 and names the offending symbols on failure.
set -eu
so=$1
archive=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Defined dynamic symbols, without version suffixes (name@@VER).
nm -D --defined-only "$so" | awk 'NF >= 3 { sub(/@.*/, "", $3); print $3 }' | sort -u >"$tmp/exported"
# Global defined public-looking names of the archive (tm_ followed by a letter or digit).
nm -g --defined-only "$archive" | awk 'NF >= 3 && $3 ~ /^tm_[a-z0-9]/ { print $3 }' | sort -u >"$tmp/public"

status=0
# Added by some linkers (_edata, _end, __bss_start on older binutils; _init, _fini) and by
# ASan/UBSan instrumentation (SAN=1 builds); none of them are ours.
grep -v -E '^(_edata|_end|__bss_start|_init|_fini|__asan_.*|__odr_asan.*|__sancov_.*|__ubsan_.*)$' \
    "$tmp/exported" >"$tmp/ours" || true

if grep '^tm__' "$tmp/ours" >"$tmp/bad"; then
    echo "check-exports: $so exports $(wc -l <"$tmp/bad") private tm__ symbol(s):" >&2
    sed 's/^/  /' "$tmp/bad" >&2
    status=1
fi
if comm -23 "$tmp/ours" "$tmp/public" | grep -v '^tm__' >"$tmp/bad"; then
    echo "check-exports: $so exports symbol(s) that are not public tm_ functions of $archive:" >&2
    sed 's/^/  /' "$tmp/bad" >&2
    status=1
fi
if comm -13 "$tmp/ours" "$tmp/public" >"$tmp/bad" && [ -s "$tmp/bad" ]; then
    echo "check-exports: $so does not export these tm_ functions of $archive (declare them in" >&2
    echo "include/tinymoe.h with TM_API, or rename them tm__ if they are private):" >&2
    sed 's/^/  /' "$tmp/bad" >&2
    status=1
fi
[ "$status" -eq 0 ] && echo "check-exports: $so exports the $(wc -l <"$tmp/public") public tm_ functions and nothing else"
exit "$status"
