#!/usr/bin/env bash
# ckpt_io.sh — checkpoint save / load GB/s beside raw writes and reads of the same bytes on the
# same disk, in one run (issue 21). Makes a checkpoint with `tinymoe train --steps 1` (model,
# AdamW state, meta: what a run saves), then runs build/bench/ckpt_io on it (bench/ckpt_io.c
# says what each row measures).
#
#   bench/ckpt_io.sh [--preset coarse|fine|cpu-large] [--device cpu|cuda] [--dir DIR] [--reps R]
#
# Then times `tinymoe export` (Hugging Face safetensors) of it beside a raw write of as many bytes,
# and the whole `tinymoe eval` (one batch) and `tinymoe sample` (16 tokens) commands on it.
# TINYMOE=path runs that driver binary instead of build/tinymoe for the train and export steps
# (a before / after comparison of the export in one session: keep a copy of the old binary).
#
#   cpu-large (default): d_model 512, 4 layers, 4 experts of F 1536, vocab 8192, f32 on the CPU:
#                        about 31M parameters, a 377 MB checkpoint with AdamW state.
#   coarse, fine:        the GPU presets (--device cuda --dtype bf16; synthetic vocab 32768).
# DIR (default: a fresh directory under $TMPDIR or /tmp) must be on the disk to measure.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=cpu-large device=cpu dir="" reps=2 threads=0
while [ $# -gt 0 ]; do
    case "$1" in
        --preset) preset=$2; shift 2 ;;
        --device) device=$2; shift 2 ;;
        --dir) dir=$2; shift 2 ;;
        --reps) reps=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        -h|--help) sed -n 2,15p "$0"; exit 0 ;;
        *) echo "ckpt_io.sh: unknown argument '$1'" >&2; exit 2 ;;
    esac
done
make -s -j2 build/tinymoe build/bench/ckpt_io >/dev/null
tinymoe=${TINYMOE:-./build/tinymoe}
[ -n "$dir" ] || dir=$(mktemp -d "${TMPDIR:-/tmp}/ckpt_io.XXXXXX")
mkdir -p "$dir"
run="$dir/run"
rm -rf "$run"
# The model trains one step on text of this repository (its docs) through a byte-level BPE
# trained here, so that the checkpoint has a tokenizer and `tinymoe sample` can run on it below;
# the vocabulary stays the preset's (the BPE has fewer tokens: these docs have too few merges).
cat docs/*.md README.md > "$dir/text.txt"
case "$preset" in
    cpu-large) vocab=8192 ;;
    coarse|fine) vocab=32768 ;;
    *) echo "ckpt_io.sh: unknown preset '$preset' (coarse, fine, cpu-large)" >&2; exit 2 ;;
esac
"$tinymoe" tokenize --bpe "$vocab" "$dir/text.txt" "$dir/tok.bin" >/dev/null
data="--data $dir/tok.bin --tokenizer $dir/tokenizer.json --vocab_size $vocab"
case "$preset" in
    cpu-large)
        "$tinymoe" train --device "$device" --d_model 512 --n_layers 4 --n_heads 8 --n_kv_heads 8 \
            --num_experts 4 --topk 2 --expert_ffn_size 1536 --seq_len 32 --batch_size 2 $data \
            --steps 1 --eval_every 0 --sample_tokens 0 --threads "$threads" --out "$run" >/dev/null ;;
    coarse|fine)
        "$tinymoe" train --preset "$preset" --device "$device" --dtype bf16 --steps 1 --eval_every 0 $data \
            --sample_tokens 0 --out "$run" >/dev/null ;;
esac
ckpt=$(ls "$run"/ckpt-*.tmck | tail -1)
echo "machine: $(nproc) cores, $(uname -srm); disk of $dir: $(df -h "$dir" | awk 'NR==2 {print $1, $2}'); $(date -u +%F)"
./build/bench/ckpt_io "$ckpt" --device "$device" --dir "$dir" --reps "$reps" --threads "$threads"

# The Hugging Face export of the same checkpoint: the whole `tinymoe export` command (reading the
# weights, writing model.safetensors with fsync), beside two yardsticks on the same disk: a raw
# write of as many bytes (dd, 8 MiB blocks, fsync, the source in the page cache), and a raw copy
# of as many bytes out of the checkpoint file, cold, into a new file with fsync (what an export
# must do at the least: read the weights from the disk and write them). Page cache dropped first
# where allowed, as ckpt_io does.
sync; (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null || true
t0=$(date +%s.%N)
"$tinymoe" export --ckpt "$ckpt" --out "$dir/hf" >/dev/null
t1=$(date +%s.%N)
st_bytes=$(stat -c %s "$dir/hf/model.safetensors")
blocks=$(( (st_bytes + 8388607) / 8388608 ))
dd if=/dev/urandom of="$dir/hf_raw" bs=8M count=$blocks iflag=fullblock status=none
t3=$(date +%s.%N)
dd if="$dir/hf_raw" of="$dir/hf_raw2" bs=8M conv=fsync status=none
t4=$(date +%s.%N)
rm -f "$dir/hf_raw2"
sync; (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null || true
t5=$(date +%s.%N)
dd if="$ckpt" of="$dir/hf_raw2" bs=8M count=$blocks iflag=fullblock conv=fsync status=none
t6=$(date +%s.%N)
awk -v b="$st_bytes" -v t0="$t0" -v t1="$t1" -v t3="$t3" -v t4="$t4" -v t5="$t5" -v t6="$t6" 'BEGIN {
    e = t1 - t0; r = t4 - t3; c = t6 - t5;
    printf "  %-34s %10.1f %10.3f %8.3f\n", "export (HF safetensors, command)", b / 1e6, e, b / 1e9 / e;
    printf "  %-34s %10.1f %10.3f %8.3f\n", "raw write, same bytes (dd, fsync)", b / 1e6, r, b / 1e9 / r;
    printf "  %-34s %10.1f %10.3f %8.3f\n", "raw copy out of the ckpt (cold)", b / 1e6, c, b / 1e9 / c;
    printf "  export / raw write: %.2fx the time; export / raw copy: %.2fx\n", e / r, e / c;
    printf "RESULT export_bytes=%d export_s=%.3f export_raw_write_s=%.3f export_raw_copy_s=%.3f\n", b, e, r, c }'

# How soon eval and sample answer from the checkpoint (issue 21: "start in a few seconds"): the
# whole command, page cache dropped first where allowed: one evaluation batch, and 16 greedy
# tokens (the model's load, the weights only, is most of either).
timed() { # label, command...
    local label=$1; shift
    sync; (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null || true
    local a b
    a=$(date +%s.%N)
    "$@" >/dev/null 2>&1 || { echo "ckpt_io.sh: '$*' failed" >&2; exit 1; }
    b=$(date +%s.%N)
    awk -v l="$label" -v a="$a" -v b="$b" 'BEGIN { printf "  %-34s %10s %10.3f\n", l, "", b - a }'
    eval "${label%% *}_s=\$(awk -v a=$a -v b=$b 'BEGIN { printf \"%.3f\", b - a }')"
}
timed "eval (1 batch), command" "$tinymoe" eval --ckpt "$ckpt" --data "$dir/tok.bin" --eval_batches 1 --device "$device" --quiet
timed "sample (16 tokens), command" "$tinymoe" sample --ckpt "$ckpt" --tokens 16 --prompt "The" --temperature 0 --device "$device"
echo "RESULT eval_s=$eval_s sample_s=$sample_s"
rm -rf "$dir/hf" "$dir/hf_raw" "$dir/hf_raw2" "$run" "$dir/text.txt" "$dir/tok.bin" "$dir/tok_val.bin" "$dir/tokenizer.json"
