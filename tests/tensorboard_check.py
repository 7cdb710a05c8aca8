"""Oracle of tests/test_tensorboard.c: the `tensorboard` package's own event reader
(EventAccumulator, which drops orphaned data as TensorBoard's UI does) reads the event files
that `tinymoe train --tensorboard DIR` wrote, and every scalar must equal the run's record in
metrics.jsonl (same steps, values as float32).

    python3 tests/tensorboard_check.py TB_DIR METRICS_JSONL N_MOE_LAYERS
Exit 0 and one line "ok: ..." when they agree; 1 with the differences otherwise.
"""
import json
import sys

import numpy as np
from tensorboard.backend.event_processing import event_accumulator as ea

tb_dir, metrics_path, n_moe = sys.argv[1], sys.argv[2], int(sys.argv[3])
acc = ea.EventAccumulator(tb_dir, size_guidance={ea.SCALARS: 0})
acc.Reload()
tags = set(acc.Tags()["scalars"])
records = [json.loads(line) for line in open(metrics_path)]

# tag -> (record type, key)
expect = {
    "loss/train": ("train", "loss"),
    "loss/cross_entropy": ("train", "ce"),
    "moe/aux_loss": ("train", "aux"),
    "moe/z_loss": ("train", "z"),
    "optim/lr": ("train", "lr"),
    "optim/grad_norm": ("train", "grad_norm"),
    "perf/tokens_per_s": ("train", "tokens_per_s"),
    "perf/ms_per_step": ("train", "ms_per_step"),
    "moe/max_load": ("train", "max_load"),
    "loss/validation": ("eval", "val_loss"),
}
errors, n = [], 0
for tag, (kind, key) in expect.items():
    want = [(r["step"], np.float32(r[key])) for r in records if r["type"] == kind]
    got = [(e.step, np.float32(e.value)) for e in acc.Scalars(tag)] if tag in tags else []
    if [s for s, _ in got] != [s for s, _ in want]:
        errors.append(f"{tag}: steps {[s for s, _ in got]} in the event files, {[s for s, _ in want]} in metrics.jsonl")
        continue
    for (s, g), (_, w) in zip(got, want):
        if g != w:
            errors.append(f"{tag} at step {s}: {g!r} in the event files, {w!r} in metrics.jsonl")
        n += 1
layers = sorted(t for t in tags if t.startswith("moe/max_load/layer_"))
if len(layers) != n_moe:
    errors.append(f"{len(layers)} per-layer max-load tags ({layers}), expected {n_moe}")
train_steps = [r["step"] for r in records if r["type"] == "train"]
for t in layers:
    ev = acc.Scalars(t)
    if [e.step for e in ev] != train_steps:
        errors.append(f"{t}: steps {[e.step for e in ev]}, expected {train_steps}")
    if any(not (e.value >= 1.0) for e in ev):
        errors.append(f"{t}: a max load below 1 (max over the mean): {[e.value for e in ev]}")
if errors:
    print("\n".join(errors))
    sys.exit(1)
print(f"ok: {n} scalars of {len(expect)} tags and {len(layers)} layer tags match metrics.jsonl")
