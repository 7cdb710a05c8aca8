#!/usr/bin/env python3
"""attention_torch.py -- causal GQA attention in PyTorch (SDPA), timed as bench/attention.c times tm_attention.

q [B,S,Hq,D], k and v [B,S,Hkv,D] bf16 leaves drawn N(0, 1) (the layout of a Llama / Mixtral
implementation, and of tm_attention), the upstream gradient N(0, 1); each call transposes them
to SDPA's (B, H, S, D) (views) and back, and runs F.scaled_dot_product_attention(is_causal=True)
with PyTorch's own choice of backend, in two variants:
  sdpa_gqa     enable_gqa=True (PyTorch >= 2.5): the kv heads are shared, not copied
  sdpa_repeat  k and v repeated Hq/Hkv times (repeat_interleave) first, as older code does
An iteration: the call, then (fwd+bwd) out.backward(dy); .grad accumulates (no zero_grad), as
tinymoe's gradients do.
FLOPs: forward 2 B Hq S^2 D (causal half of 4 B Hq S^2 D), forward + backward 3.5 times that.
Output: human lines, then one machine-readable line per variant
  RESULT bench=attention impl=sdpa_gqa D=... ms_fwd=... ms_fwdbwd=... tflops_fwd=... tflops_fwdbwd=...
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F


def sdpa_gqa(q, k, v):
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=True)
    return o.transpose(1, 2)


def sdpa_repeat(q, k, v):
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return o.transpose(1, 2)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_loop(fn, q, k, v, dy, backward, warmup, iters, device):
    for it in range(warmup + iters):
        if it == warmup:
            sync(device)
            t0 = time.perf_counter()
        o = fn(q, k, v)
        if backward:
            o.backward(dy)
    sync(device)
    return (time.perf_counter() - t0) / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--S", type=int, default=1024)
    ap.add_argument("--Hq", type=int, default=12)
    ap.add_argument("--Hkv", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--variants", default="gqa,repeat", help="comma-separated: gqa, repeat")
    a = ap.parse_args()
    if a.Hq % a.Hkv:
        ap.error("--Hkv must divide --Hq")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("attention_torch: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 3
    torch.manual_seed(a.seed)
    dev = a.device
    q = torch.randn(a.B, a.S, a.Hq, a.D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(a.B, a.S, a.Hkv, a.D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(a.B, a.S, a.Hkv, a.D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(a.B, a.S, a.Hq, a.D, device=dev, dtype=torch.bfloat16)
    fl_f = 2.0 * a.B * a.Hq * a.S * a.S * a.D
    fl_fb = 3.5 * fl_f
    print(f"pytorch {torch.__version__} attention on {dev}: B={a.B} S={a.S} Hq={a.Hq} Hkv={a.Hkv} D={a.D} bf16 causal; "
          f"{a.warmup} warm-up + {a.iters} timed iterations")
    fns = {"gqa": sdpa_gqa, "repeat": sdpa_repeat}
    for var in [s for s in a.variants.split(",") if s]:
        if var not in fns:
            ap.error(f"unknown variant '{var}' (gqa, repeat)")
        name = "sdpa_" + var
        try:
            fwd = time_loop(fns[var], q, k, v, dy, False, a.warmup, a.iters, dev)
            fb = time_loop(fns[var], q, k, v, dy, True, a.warmup, a.iters, dev)
        except (RuntimeError, TypeError) as e:  # enable_gqa before torch 2.5, a backend refusing
            print(f"  {name}: failed: {str(e).splitlines()[0]}")
            continue
        print(f"  {name:12s} forward {1e3 * fwd:8.3f} ms {fl_f / fwd / 1e12:7.1f} TFLOP/s   forward+backward "
              f"{1e3 * fb:8.3f} ms {fl_fb / fb / 1e12:7.1f} TFLOP/s")
        print(f"RESULT bench=attention impl={name} device={dev} B={a.B} S={a.S} Hq={a.Hq} Hkv={a.Hkv} D={a.D} "
              f"ms_fwd={1e3 * fwd:.4f} ms_fwdbwd={1e3 * fb:.4f} tflops_fwd={fl_f / fwd / 1e12:.2f} "
              f"tflops_fwdbwd={fl_fb / fb / 1e12:.2f} torch={torch.__version__} iters={a.iters}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
