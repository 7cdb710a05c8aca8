#!/usr/bin/env python3
"""moe_layer_torch.py -- the MoE layer of bench/moe_layer.c in PyTorch, timed the same way.

The layer, written as a PyTorch user writes a fast dropless MoE (torchtitan style):
  logits = f32(x) @ gate (f32)            x [T,H] bf16, gate [H,E] f32
  p, idx = topk(softmax(logits), k); p /= sum(p)          (norm_topk_prob)
  sort the T*k expert ids (stable: rows expert-major, tokens ascending within an expert, the
  order of tinymoe's permute); group ends offs[e] = searchsorted(sorted ids, e + 1) (int32,
  on the device: no host read)
  xs = x[token of each sorted row]                          (R = T*k rows)
  gu = torch._grouped_mm(xs, w_gate_up, offs)               w_gate_up [E,H,2F] bf16 (gate and up
                                                            fused: one GEMM of N = 2F)
  h  = silu(gate half) * (up half)
  o  = torch._grouped_mm(h, w_down, offs)                   w_down [E,F,H] bf16
  y  = sum over the k slots of f32(o back in token order) * p   (f32 accumulation), cast to bf16
No auxiliary loss, no z-loss (as the C side). Weights N(0, 0.02), x and dy N(0, 1).
An iteration: forward, then (fwd+bwd) y.backward(dy); gradients accumulate into .grad across
iterations (no zero_grad), as tinymoe's do. Implementations: eager, and torch.compile of the
layer function (default mode; its compilation happens in the warm-up, untimed).
Without torch._grouped_mm (torch < 2.8) the experts run as a loop over expert slices.

FLOPs: the expert GEMMs, 6 T k H F forward, 18 T k H F forward + backward (bench/moe_layer.c).
Output: human lines, then one machine-readable line per implementation
  RESULT bench=moe_layer impl=torch_eager ms_fwd=... ms_fwdbwd=... tflops_fwd=... tflops_fwdbwd=...
"""
import argparse
import sys
import time

import torch
import torch.nn.functional as F


def grouped_mm(a, b, offs):
    """a [R,K] rows grouped by offs (group ends), b [G,K,N] -> [R,N]."""
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, b, offs=offs)
    outs, start = [], 0
    for g, end in enumerate(offs.tolist()):  # a host read: only on old torch
        outs.append(a[start:end] @ b[g])
        start = end
    return torch.cat(outs)


def route(x, gate_w, k):
    """Router: logits f32 [T,E], softmax scores [T,E], weights p [T,k] (sum 1), experts idx [T,k]."""
    logits = x.float() @ gate_w                          # (T,E) f32
    scores = logits.softmax(dim=-1)
    p, idx = scores.topk(k, dim=-1)                      # (T,k)
    p = p / p.sum(dim=-1, keepdim=True)
    return logits, scores, p, idx


def experts(x, p, idx, w_gate_up, w_down):
    """The routed experts: x [T,H] (each token to its k experts idx, weights p) -> y [T,H]."""
    T, H = x.shape
    E, k = w_gate_up.shape[0], idx.shape[1]
    flat = idx.reshape(-1)                               # (R,) expert of each (token, slot)
    sorted_ids, order = flat.sort(stable=True)           # expert-major, (token, slot) ascending
    ends = torch.arange(1, E + 1, device=x.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, ends).to(torch.int32)  # (E,) group ends
    xs = x.index_select(0, order // k)                   # (R,H)
    gu = grouped_mm(xs, w_gate_up, offs)                 # (R,2F)
    g, u = gu.chunk(2, dim=-1)
    o = grouped_mm(F.silu(g) * u, w_down, offs)          # (R,H)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=x.device)
    o = o.index_select(0, inv).view(T, k, H)             # (T,k,H): token order
    y = (o.float() * p.unsqueeze(-1)).sum(dim=1)
    return y.to(x.dtype)


def moe_forward(x, gate_w, w_gate_up, w_down, k):
    """Routed experts of one MoE layer: x [T,H] -> y [T,H] (x's dtype)."""
    _, _, p, idx = route(x, gate_w, k)
    return experts(x, p, idx, w_gate_up, w_down)


class Experts(torch.nn.Module):
    """The routed part of a Mixtral-style MoE block, with the layout above."""

    def __init__(self, H, F_, E, k, std=0.02, out_std=0.02, device=None, dtype=torch.bfloat16):
        super().__init__()
        self.k = k
        self.gate = torch.nn.Parameter(torch.empty(H, E, device=device, dtype=torch.float32))
        self.w_gate_up = torch.nn.Parameter(torch.empty(E, H, 2 * F_, device=device, dtype=dtype))
        self.w_down = torch.nn.Parameter(torch.empty(E, F_, H, device=device, dtype=dtype))
        torch.nn.init.normal_(self.gate, 0.0, std)
        torch.nn.init.normal_(self.w_gate_up, 0.0, std)
        torch.nn.init.normal_(self.w_down, 0.0, out_std)

    def forward(self, x):
        return moe_forward(x, self.gate, self.w_gate_up, self.w_down, self.k)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_loop(fn, x, dy, backward, warmup, iters, device):
    for it in range(warmup + iters):
        if it == warmup:
            sync(device)
            t0 = time.perf_counter()
        y = fn(x)
        if backward:
            y.backward(dy)
    sync(device)
    return (time.perf_counter() - t0) / iters


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--H", type=int, default=2048)
    ap.add_argument("--F", type=int, default=1408)
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--impls", default="eager,compile", help="comma-separated: eager, compile")
    a = ap.parse_args()
    impls = [s for s in a.impls.split(",") if s]
    if any(s not in ("eager", "compile") for s in impls) or not impls:
        ap.error("--impls takes eager and/or compile")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("moe_layer_torch: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 3
    torch.manual_seed(a.seed)
    dev = a.device
    moe = Experts(a.H, a.F, a.E, a.k, device=dev)
    x = torch.randn(a.T, a.H, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(a.T, a.H, device=dev, dtype=torch.bfloat16)

    with torch.no_grad():
        _, idx = (x.float() @ moe.gate).softmax(-1).topk(a.k, dim=-1)
        load = torch.bincount(idx.reshape(-1), minlength=a.E).float()
        max_load = (load.max() / load.mean()).item()

    fl_f = 6.0 * a.T * a.k * a.H * a.F
    fl_fb = 3.0 * fl_f
    gm = "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "a loop over experts"
    print(f"pytorch {torch.__version__} moe_layer on {dev}: T={a.T} H={a.H} F={a.F} E={a.E} k={a.k} bf16, "
          f"experts through {gm}; expert load max/mean {max_load:.3f}; {a.warmup} warm-up + {a.iters} timed iterations")
    for impl in impls:
        fn = moe if impl == "eager" else torch.compile(moe)
        t_c = time.perf_counter()
        fwd = time_loop(fn, x, dy, False, a.warmup, a.iters, dev)
        fb = time_loop(fn, x, dy, True, a.warmup, a.iters, dev)
        total = time.perf_counter() - t_c
        name = "torch_" + impl
        print(f"  {name:14s} forward {1e3 * fwd:9.3f} ms {fl_f / fwd / 1e12:8.1f} TFLOP/s   forward+backward "
              f"{1e3 * fb:9.3f} ms {fl_fb / fb / 1e12:8.1f} TFLOP/s   ({total:.1f} s with warm-up)")
        print(f"RESULT bench=moe_layer impl={name} device={dev} T={a.T} H={a.H} F={a.F} E={a.E} k={a.k} "
              f"ms_fwd={1e3 * fwd:.4f} ms_fwdbwd={1e3 * fb:.4f} tflops_fwd={fl_f / fwd / 1e12:.2f} "
              f"tflops_fwdbwd={fl_fb / fb / 1e12:.2f} max_load={max_load:.3f} torch={torch.__version__} "
              f"iters={a.iters}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
