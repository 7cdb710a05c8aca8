#!/usr/bin/env python3
"""tests/gpu/hf_check.py — tinymoe's Hugging Face export against transformers.

    python3 tests/gpu/hf_check.py DIR [--tol 1e-4]

DIR holds one sub-directory per case (written by the Criterion test hf/transformers_reference
with TM_HF_DUMP_DIR=DIR): config.json and model.safetensors from tinymoe's export, tokens.npy
(int32 [B, T]) and logits.npy (float32 [B, T, V], tinymoe's logits for those tokens). For each
case, MixtralForCausalLM.from_pretrained loads the export in float32 with eager attention; any
missing, unexpected or mismatched weight is a failure (transformers would otherwise initialise
it at random and carry on). The logits are computed on the CPU and, when there is one, on the
GPU (TF32 off), and compared with tinymoe's: max |diff|, max |diff| / max |logit|, and whether
every position's argmax agrees. Exit status 1 when a case fails, 2 on bad arguments.
"""
import argparse
import json
import os
import sys
import traceback

import numpy as np
import torch
import transformers
from transformers import MixtralForCausalLM


def load(d):
    kwargs = dict(attn_implementation="eager", output_loading_info=True)
    try:  # transformers 5 calls it dtype; 4.x torch_dtype
        return MixtralForCausalLM.from_pretrained(d, dtype=torch.float32, **kwargs)
    except TypeError:
        return MixtralForCausalLM.from_pretrained(d, torch_dtype=torch.float32, **kwargs)


def check_file(d):
    """The safetensors reference implementation reads every tensor of the file."""
    from safetensors import safe_open
    n = 0
    with safe_open(os.path.join(d, "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
        for k in f.keys():
            f.get_tensor(k)
            n += 1
    print(f"  safetensors {safetensors_version()}: {n} tensors read, metadata {meta}")


def safetensors_version():
    import safetensors
    return getattr(safetensors, "__version__", "?")


def check_case(d, tol):
    check_file(d)
    cfg = json.load(open(os.path.join(d, "config.json")))
    tokens = np.load(os.path.join(d, "tokens.npy"))
    ref = np.load(os.path.join(d, "logits.npy")).astype(np.float64)
    model, info = load(d)
    ok = True
    for k, v in info.items():
        if v:
            print(f"  FAIL loading: {k}: {v}")
            ok = False
    hc = model.config
    theta = (getattr(hc, "rope_parameters", None) or {}).get("rope_theta", getattr(hc, "rope_theta", None))
    print(f"  config: {cfg['num_hidden_layers']} layers, hidden {hc.hidden_size}, heads {hc.num_attention_heads}/"
          f"{hc.num_key_value_heads}, experts {hc.num_local_experts} top-{hc.num_experts_per_tok}, "
          f"ffn {hc.intermediate_size}, vocab {hc.vocab_size}, rope_theta {theta}, file dtype {cfg.get('torch_dtype')}")
    if theta is None or float(theta) != float(cfg["rope_theta"]):
        print(f"  FAIL: transformers reads rope_theta {theta}, the file says {cfg['rope_theta']}")
        ok = False
    layer0 = model.model.layers[0]
    moe = layer0.mlp if hasattr(layer0, "mlp") else layer0.block_sparse_moe  # 5.x / 4.x
    n_params = sum(p.numel() for p in model.parameters())
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    print(f"  loaded {n_params} parameters, MoE block {type(moe).__name__}, lm_head tied: {tied}")
    if tied != bool(cfg["tie_word_embeddings"]):
        print(f"  FAIL: tie_word_embeddings is {cfg['tie_word_embeddings']} but lm_head tied is {tied}")
        ok = False
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        m = model.to(dev).eval()
        with torch.no_grad():
            out = m(torch.from_numpy(tokens.astype(np.int64)).to(dev)).logits.double().cpu().numpy()
        if out.shape != ref.shape:
            print(f"  FAIL {dev}: logits shape {out.shape}, tinymoe {ref.shape}")
            ok = False
            continue
        diff = np.abs(out - ref)
        mx, big = diff.max(), np.abs(ref).max()
        agree = (out.argmax(-1) == ref.argmax(-1)).mean()
        good = mx <= tol
        ok &= bool(good)
        print(f"  {dev}: max |diff| {mx:.3e}, mean |diff| {diff.mean():.3e}, max |logit| {big:.3f}, "
              f"relative {mx / big:.3e}, argmax agreement {agree * 100:.1f}% -> {'ok' if good else 'FAIL'} (tol {tol:g})")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest allowed |logit difference| (default 1e-4)")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
    cases = sorted(c for c in os.listdir(a.dir) if os.path.isfile(os.path.join(a.dir, c, "config.json")))
    if not cases:
        print(f"hf_check: no case directories with config.json under {a.dir}", file=sys.stderr)
        return 2
    failed = []
    for c in cases:
        print(f"case {c}:")
        try:
            ok = check_case(os.path.join(a.dir, c), a.tol)
        except Exception:
            traceback.print_exc(file=sys.stdout)
            ok = False
        if not ok:
            failed.append(c)
    print("hf_check: " + (f"FAILED: {', '.join(failed)}" if failed else f"all {len(cases)} cases ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
