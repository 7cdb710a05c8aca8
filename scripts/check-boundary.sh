#!/bin/sh
# check-boundary.sh — layers/, optim/ and checkpoints/ see the runtime only through the public
# include/tinymoe.h and the one documented extension header framework/extend.h.
#
#   scripts/check-boundary.sh          (from the repository root)
#
# Fails (exit 1, naming file and line) when a source or header there includes any other header
# of framework/ (internal.h, ctx_internal.h, backend.h, comm.h, ...), by plain name or by path.
# Run by `make test` and `make check-boundary`.
set -eu
cd "$(dirname "$0")/.."

# Headers of framework/ other than extend.h, by base name.
private=$(cd framework && ls *.h *.def 2>/dev/null | grep -v -x 'extend.h' || true)
status=0
for f in $(find layers optim checkpoints -name '*.[ch]' | sort); do
    # Quoted includes: the base name of what is included, with its line number.
    grep -n -E '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" |
        sed -E 's/^([0-9]+):[^"]*"([^"]*)".*/\1 \2/' >"${TMPDIR:-/tmp}/check-boundary.$$" || true
    while read -r line inc; do
        base=${inc##*/}
        for p in $private; do
            if [ "$base" = "$p" ]; then
                echo "check-boundary: $f:$line includes \"$inc\"; layers/, optim/ and checkpoints/ may use only tinymoe.h and framework/extend.h" >&2
                status=1
            fi
        done
    done <"${TMPDIR:-/tmp}/check-boundary.$$"
done
rm -f "${TMPDIR:-/tmp}/check-boundary.$$"
[ "$status" -eq 0 ] && echo "check-boundary: layers/, optim/, checkpoints/ include only tinymoe.h and extend.h"
exit "$status"
