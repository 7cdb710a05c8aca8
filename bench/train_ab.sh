#!/usr/bin/env bash
# train_ab.sh — a training step's time before and after a change: this tree against another
# revision, both built here and run alternately (REV, this tree, REV, this tree, ...) on one device,
# so that clocks, temperature and whatever else shares the machine weigh on both alike.
#
#   bench/train_ab.sh --rev REV [--presets coarse,fine] [--rounds 2] [--steps 25] [--skip 5]
#                     [--device cuda] [--dtype bf16] [--no-build] [--smoke] [-- TRAIN_ARGS...]
#
# REV (any git revision) is exported with `git archive` into build-ab/<commit>/ and built there
# with its own Makefile (`make build/tinymoe`, the Makefile's detection plus AB_MAKE_FLAGS). REV
# may also be a directory holding a source tree, built in place unless it has a build/tinymoe:
# for a clone that lacks the commit, unpack `git archive REV` there and pass the directory. This
# tree's build/tinymoe is made the same way unless --no-build. Each run is
#   tinymoe train --preset P --device D --dtype T --steps N --synthetic_vocab 1024 --seed 1 --out= \
#       --log_every 1 [TRAIN_ARGS]
# and its time is the mean of the driver's ms/step column over the steps after --skip (the first
# steps carry allocation and autotuning). The losses at the middle and the last step are kept, as
# the driver prints them (4 decimals): a change that should not move the arithmetic must leave
# them equal, and the table says whether they are, over every round of both sides (and whether a
# side's own rounds disagree, which would make its timings suspect too). One line per run, then
# per preset: REV's runs, this tree's, the change of the means in %, and the losses.
# --smoke: a CPU dry run of this script (no GPU): the default toy model, f32, 8 steps, skip 2.
# Nothing else runs on the device meanwhile unless you put it there: the figures are one machine's,
# for one comparison, not a benchmark to quote against other machines.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

rev="" presets=coarse,fine rounds=2 steps=25 skip=5 device=cuda dtype=bf16 build=1 smoke=0
while [ $# -gt 0 ]; do
    case "$1" in
    --rev|--presets|--rounds|--steps|--skip|--device|--dtype)
        [ $# -ge 2 ] || { echo "train_ab.sh: $1 needs a value" >&2; exit 2; }
        eval "${1#--}=\$2"
        shift 2 ;;
    --no-build) build=0; shift ;;
    --smoke) smoke=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,24s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "train_ab.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
extra=("$@")
[ -n "$rev" ] || { echo "train_ab.sh: --rev REV is required (the revision to compare this tree with)" >&2; exit 2; }
if [ -d "$rev" ]; then # a source tree (e.g. a `git archive` unpacked where this clone lacks the commit)
    [ -f "$rev/Makefile" ] || { echo "train_ab.sh: --rev $rev: a directory without a Makefile" >&2; exit 2; }
    commit="" dir=$(cd "$rev" && pwd) short=$(basename "$dir")
else
    commit=$(git rev-parse --verify --quiet "$rev^{commit}") ||
        { echo "train_ab.sh: --rev $rev: not a commit of this repository, nor a directory" >&2; exit 2; }
    dir=build-ab/$commit short=${commit:0:7}
fi
for v in rounds steps skip; do
    case "${!v}" in ''|*[!0-9]*) echo "train_ab.sh: --$v must be a whole number, got '${!v}'" >&2; exit 2 ;; esac
done
[ "$skip" -lt "$steps" ] || { echo "train_ab.sh: --skip $skip leaves no timed step of --steps $steps" >&2; exit 2; }
if [ "$smoke" = 1 ]; then
    device=cpu dtype=f32 presets=toy steps=8 skip=2
fi
# both trees build with the Makefile's detection (CUDA with nvcc, CBLAS with OpenBLAS, ...), as
# `make` does here; AB_MAKE_FLAGS adds to it (e.g. AB_MAKE_FLAGS='CUDA=1 BLAS=0')
read -r -a make_flags <<<"${AB_MAKE_FLAGS:-}"

if [ -z "$commit" ]; then
    if [ ! -x "$dir/build/tinymoe" ]; then
        echo "== building $short in $dir"
        (cd "$dir" && make -j"$(nproc)" ${make_flags[@]+"${make_flags[@]}"} build/tinymoe >build.log 2>&1) ||
            { echo "train_ab.sh: building $short failed; the end of $dir/build.log:" >&2; tail -20 "$dir/build.log" >&2; exit 1; }
    fi
elif [ ! -x "$dir/build/tinymoe" ]; then
    rm -rf "$dir" && mkdir -p "$dir"
    git archive "$commit" | tar -x -C "$dir" || { echo "train_ab.sh: git archive $short failed" >&2; exit 1; }
    echo "== building $short in $dir"
    (cd "$dir" && make -j"$(nproc)" ${make_flags[@]+"${make_flags[@]}"} build/tinymoe >build.log 2>&1) ||
        { echo "train_ab.sh: building $short failed; the end of $dir/build.log:" >&2; tail -20 "$dir/build.log" >&2; exit 1; }
fi
if [ "$build" = 1 ]; then
    echo "== building this tree"
    mkdir -p build-ab
    make -j"$(nproc)" ${make_flags[@]+"${make_flags[@]}"} build/tinymoe >build-ab/this.log 2>&1 ||
        { echo "train_ab.sh: building this tree failed; the end of build-ab/this.log:" >&2; tail -20 build-ab/this.log >&2; exit 1; }
fi
[ -x build/tinymoe ] || { echo "train_ab.sh: no build/tinymoe in this tree (drop --no-build)" >&2; exit 1; }

# one run: prints "<mean ms/step> <timed steps> <loss at the middle step> <loss at the last step>"
run() {
    local bin=$1 preset=$2 log=$3 args=()
    [ "$preset" != toy ] && args=(--preset "$preset")
    "$bin" train ${args[@]+"${args[@]}"} --device "$device" --dtype "$dtype" --steps "$steps" --synthetic_vocab 1024 \
        --seed 1 --out= --log_every 1 ${extra[@]+"${extra[@]}"} >"$log" 2>&1 || { echo "fail"; return; }
    awk -v skip="$skip" -v mid=$((steps / 2)) -v last="$steps" '
        $1 == "step" && !c { for (i = 1; i <= NF; i++) { if ($i == "ms/step") c = i; if ($i == "loss") lc = i }; next }
        c && $1 ~ /^[0-9]+$/ { if ($1 > skip) { s += $c; n++ } if ($1 == mid) lm = $lc; if ($1 == last) ll = $lc }
        END { if (n) printf "%.3f %d %s %s\n", s / n, n, lm, ll; else print "fail" }' "$log"
}

echo "== $short against this tree: ${presets//,/ }, $rounds rounds, $steps steps (mean of steps $((skip + 1))-$steps), $device $dtype"
mkdir -p build-ab/logs
summary=()
for preset in ${presets//,/ }; do
    a_ms=() b_ms=() a_loss="" b_loss="" a_var=0 b_var=0
    for r in $(seq 1 "$rounds"); do
        for side in rev this; do
            bin=build/tinymoe
            [ $side = rev ] && bin=$dir/build/tinymoe
            log=build-ab/logs/$preset-$side-$r.log
            read -r ms n lm ll < <(run "$bin" "$preset" "$log")
            if [ "$ms" = fail ]; then
                echo "train_ab.sh: $preset round $r ($side) failed; the end of $log:" >&2
                tail -5 "$log" >&2
                exit 1
            fi
            label=$short
            [ $side = this ] && label=this
            printf '%-8s round %d %-7s %8.2f ms/step (%d steps)  loss %s / %s\n' "$preset" "$r" "$label" "$ms" "$n" "$lm" "$ll"
            if [ $side = rev ]; then
                a_ms+=("$ms"); [ -n "$a_loss" ] && [ "$a_loss" != "$lm/$ll" ] && a_var=1; a_loss="$lm/$ll"
            else
                b_ms+=("$ms"); [ -n "$b_loss" ] && [ "$b_loss" != "$lm/$ll" ] && b_var=1; b_loss="$lm/$ll"
            fi
        done
    done
    note=""
    [ $a_var = 1 ] && note+=" ($short's rounds disagree)"
    [ $b_var = 1 ] && note+=" (this tree's rounds disagree)"
    summary+=("$(awk -v p="$preset" -v a="${a_ms[*]}" -v b="${b_ms[*]}" -v la="$a_loss" -v lb="$b_loss" -v note="$note" 'BEGIN {
        na = split(a, x, " "); nb = split(b, y, " "); for (i = 1; i <= na; i++) sa += x[i]; for (i = 1; i <= nb; i++) sb += y[i]
        ma = sa / na; mb = sb / nb
        printf "%-8s %-22s %-22s %+7.1f%%  %s%s\n", p, a, b, 100 * (mb - ma) / ma, la == lb ? "same (" la ")" : la " -> " lb, note }')")
done
echo
printf '%-8s %-22s %-22s %8s  %s\n' preset "$short ms/step" "this tree ms/step" change "losses (middle/last step)"
printf '%s\n' "${summary[@]}"
