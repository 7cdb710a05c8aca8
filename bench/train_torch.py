#!/usr/bin/env python3
"""train_torch.py -- the `tinymoe train` model in PyTorch, bf16, timed as bench/train_gpu.sh times tinymoe.

bench/train_gpu.sh passes the model and optimizer keys that `tinymoe train --preset NAME`
printed, so both train the same model (Mixtral-style, written as a PyTorch user would):
  tokens -> embedding -> n_layers x [x += attn(rmsnorm(x)); x += moe(rmsnorm(x))]
         -> rmsnorm -> lm_head (untied) -> logits
  rmsnorm  F.rms_norm (f32 inside), eps norm_eps
  attn     wq, wk, wv, wo without bias; rotary embeddings (rotate-half, theta rope_theta, in
           f32); F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) on (B,H,T,D)
           views (k, v repeated for torch < 2.5)
  moe      bench/moe_layer_torch.py: router f32(x) @ gate (f32), softmax, top-k, weights
           renormalised; sorted dispatch; torch._grouped_mm for the fused gate/up [E,H,2F] and
           down [E,F,H] projections, SwiGLU; weighted combine in f32. Switch load-balancing
           loss (aux_loss_coeff, tinymoe.h tm_moe_aux_loss) and router z-loss (z_loss_coeff)
  loss     cross-entropy of f32(logits) + the layers' aux and z losses
Weights bf16 (the router gate f32, as tinymoe's), N(0, init_std), residual output projections
(attn wo, experts' down) init_std / sqrt(2 n_layers), norm weights 1.
A step: forward, backward, clip_grad_norm_(grad_clip), fused AdamW (weight decay on >= 2-D
parameters; its state in the parameters' dtype: bf16, where tinymoe keeps f32 master weights
and f32 moments), zero_grad, and loss.item() (tinymoe reads its loss back every step too).
The learning rate warms up linearly over warmup_steps (tinymoe's schedule; the decay is left
out: it changes nothing of the work).
Tokens uniform in [0, data_vocab) (train_gpu.sh gives 1024, tinymoe's synthetic vocabulary).
Implementations: eager; compile (torch.compile of each block and of the head + loss, as
torchtitan does: one compilation serves every block; compiled in the warm-up steps).

Throughput: tokens/s over the timed steps (after the warm-up); MFU = tokens/s x
flops_per_token / peak, flops_per_token = 6 (active parameters - the embedding table)
+ 12 n_layers d_model seq (PaLM appendix B / llm.c: attention without the causal halving).
Output: human lines, then one machine-readable line per implementation
  RESULT bench=train impl=torch_eager tokens_per_s=... ms_per_step=... mfu=... params=... active=...
"""
import argparse
import math
import os
import sys
import time

import torch
import torch._dynamo
import torch.nn as nn
import torch.nn.functional as F

sys.dont_write_bytecode = True  # no bench/__pycache__ in the work tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_layer_torch import experts, route  # noqa: E402


def rms_norm(x, w, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def rope_tables(seq, head_dim, theta, device):
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    ang = torch.cat([ang, ang], dim=-1)  # (T, D)
    return ang.cos().float().to(device), ang.sin().float().to(device)


def apply_rope(x, cos, sin):
    # x (B, T, H, D); cos, sin (T, D); rotate-half, in f32, rounded once
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


class Block(nn.Module):
    def __init__(self, c, dtype, device):
        super().__init__()
        H, D = c.d_model, c.d_model // c.n_heads
        self.c, self.h, self.hkv, self.d = c, c.n_heads, c.n_kv_heads, D
        kw = dict(device=device, dtype=dtype)
        self.attn_norm = nn.Parameter(torch.ones(H, **kw))
        self.wq = nn.Parameter(torch.empty(H, self.h * D, **kw))
        self.wk = nn.Parameter(torch.empty(H, self.hkv * D, **kw))
        self.wv = nn.Parameter(torch.empty(H, self.hkv * D, **kw))
        self.wo = nn.Parameter(torch.empty(self.h * D, H, **kw))
        self.ffn_norm = nn.Parameter(torch.ones(H, **kw))
        self.gate = nn.Parameter(torch.empty(H, c.num_experts, device=device, dtype=torch.float32))
        self.w_gate_up = nn.Parameter(torch.empty(c.num_experts, H, 2 * c.expert_ffn_size, **kw))
        self.w_down = nn.Parameter(torch.empty(c.num_experts, c.expert_ffn_size, H, **kw))

    def forward(self, x, cos, sin):
        c = self.c
        B, T, H = x.shape
        h = rms_norm(x, self.attn_norm, c.norm_eps)
        q = apply_rope((h @ self.wq).view(B, T, self.h, self.d), cos, sin).transpose(1, 2)
        k = apply_rope((h @ self.wk).view(B, T, self.hkv, self.d), cos, sin).transpose(1, 2)
        v = (h @ self.wv).view(B, T, self.hkv, self.d).transpose(1, 2)
        if self.hkv != self.h and not c.native_gqa:
            k = k.repeat_interleave(self.h // self.hkv, dim=1)
            v = v.repeat_interleave(self.h // self.hkv, dim=1)
        gqa = {"enable_gqa": True} if self.hkv != self.h and c.native_gqa else {}
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        x = x + a.transpose(1, 2).reshape(B, T, self.h * self.d) @ self.wo
        h = rms_norm(x, self.ffn_norm, c.norm_eps).view(B * T, H)
        logits, scores, p, idx = route(h, self.gate, c.topk)
        y = experts(h, p, idx, self.w_gate_up, self.w_down)
        # Switch aux loss and router z-loss, as tinymoe's (counts: the routed tokens per expert)
        N, E = scores.shape
        counts = torch.zeros(E, device=x.device, dtype=torch.float32).index_add_(
            0, idx.reshape(-1), torch.ones(idx.numel(), device=x.device, dtype=torch.float32))
        aux = E * c.aux_loss_coeff / (c.topk * N * N) * (scores.sum(0) * counts).sum()
        z = c.z_loss_coeff * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return x + y.view(B, T, H), aux + z


class Model(nn.Module):
    def __init__(self, c, dtype, device):
        super().__init__()
        self.c = c
        kw = dict(device=device, dtype=dtype)
        self.embed = nn.Parameter(torch.empty(c.vocab_size, c.d_model, **kw))
        self.layers = nn.ModuleList([Block(c, dtype, device) for _ in range(c.n_layers)])
        self.norm = nn.Parameter(torch.ones(c.d_model, **kw))
        self.lm_head = nn.Parameter(torch.empty(c.d_model, c.vocab_size, **kw))
        cos, sin = rope_tables(c.seq_len, c.d_model // c.n_heads, c.rope_theta, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        std, out_std = c.init_std, c.init_std / math.sqrt(2 * c.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, out_std if name.endswith((".wo", ".w_down")) else std)
        self.head = self.head_loss

    def head_loss(self, x, targets):
        logits = rms_norm(x, self.norm, self.c.norm_eps) @ self.lm_head
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        x = F.embedding(tokens, self.embed)
        losses = 0.0
        for layer in self.layers:
            x, l = layer(x, self.cos[:T], self.sin[:T])
            losses = losses + l
        return self.head(x, targets) + losses


def param_counts(model, c):
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".w_gate_up", ".w_down")))
    active = total - routed + routed * c.topk // c.num_experts
    return total, active


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--impls", default="eager,compile", help="comma-separated: eager, compile")
    for key, typ, default in [("vocab_size", int, 32768), ("d_model", int, 768), ("n_layers", int, 12),
                              ("n_heads", int, 12), ("n_kv_heads", int, 4), ("num_experts", int, 8), ("topk", int, 2),
                              ("expert_ffn_size", int, 2048), ("seq_len", int, 1024), ("batch_size", int, 16),
                              ("rope_theta", float, 10000.0), ("norm_eps", float, 1e-5), ("init_std", float, 0.02),
                              ("aux_loss_coeff", float, 1e-2), ("z_loss_coeff", float, 1e-3), ("lr", float, 3e-4),
                              ("warmup_steps", int, 100), ("beta1", float, 0.9), ("beta2", float, 0.95),
                              ("eps", float, 1e-8), ("weight_decay", float, 0.1), ("grad_clip", float, 1.0),
                              ("data_vocab", int, 1024), ("warmup", int, 5), ("steps", int, 20), ("seed", int, 1)]:
        ap.add_argument("--" + key, type=typ, default=default)
    ap.add_argument("--peak_tflops", type=float, default=989.0, help="bf16 dense peak for the MFU (H100 SXM: 989)")
    c = ap.parse_args()
    impls = [s for s in c.impls.split(",") if s]
    if not impls or any(s not in ("eager", "compile") for s in impls):
        ap.error("--impls takes eager and/or compile")
    if c.d_model % c.n_heads or c.n_heads % c.n_kv_heads:
        ap.error("d_model % n_heads and n_heads % n_kv_heads must be 0")
    if c.device == "cuda" and not torch.cuda.is_available():
        print("train_torch: --device cuda: torch sees no CUDA device", file=sys.stderr)
        return 3
    c.native_gqa = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)
    dev = c.device
    B, T = c.batch_size, c.seq_len
    H, L = c.d_model, c.n_layers
    for impl in impls:
        torch.manual_seed(c.seed)
        model = Model(c, torch.bfloat16, dev)
        total, active = param_counts(model, c)
        flops_per_token = 6 * (active - c.vocab_size * H) + 12 * L * H * T
        if impl == "compile":
            # The blocks share one compiled graph (their parameters are graph inputs); a limit
            # above n_layers keeps a recompilation per block, should one happen, from falling
            # back to eager silently.
            for key in ("recompile_limit", "cache_size_limit"):
                if hasattr(torch._dynamo.config, key):
                    setattr(torch._dynamo.config, key, max(64, 2 * L))
            for i, blk in enumerate(model.layers):
                model.layers[i] = torch.compile(blk)
            model.head = torch.compile(model.head_loss)
        params = list(model.parameters())
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": c.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=c.lr, betas=(c.beta1, c.beta2), eps=c.eps,
                                fused=dev == "cuda")
        gen = torch.Generator(device="cpu").manual_seed(c.seed)
        loss_v, t0, t_start = float("nan"), 0.0, time.perf_counter()
        for step in range(c.warmup + c.steps):
            if step == c.warmup:
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
            rows = torch.randint(0, min(c.data_vocab, c.vocab_size), (B, T + 1), generator=gen).to(dev)
            for g in opt.param_groups:
                g["lr"] = c.lr * min(1.0, (step + 1) / max(1, c.warmup_steps))
            loss = model(rows[:, :-1], rows[:, 1:])
            loss.backward()
            if c.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, c.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_v = loss.item()
        dt = time.perf_counter() - t0
        tok_s = B * T * c.steps / dt
        mfu = tok_s * flops_per_token / (c.peak_tflops * 1e12)
        name = "torch_" + impl
        mem = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0
        print(f"pytorch {torch.__version__} {name}: {total} parameters ({active} active per token), B={B} T={T}, "
              f"{c.warmup} warm-up + {c.steps} timed steps ({time.perf_counter() - t_start:.1f} s in all): "
              f"{tok_s:.0f} tokens/s, {1e3 * dt / c.steps:.1f} ms/step, MFU {100 * mfu:.1f}%, loss {loss_v:.4f}, "
              f"peak memory {mem:.1f} GiB", flush=True)
        print(f"RESULT bench=train impl={name} device={dev} tokens_per_s={tok_s:.1f} ms_per_step={1e3 * dt / c.steps:.2f} "
              f"mfu={mfu:.4f} params={total} active={active} flops_per_token={flops_per_token} batch={B} seq={T} "
              f"steps={c.steps} loss={loss_v:.4f} torch={torch.__version__}", flush=True)
        del model, opt, params, groups
        if dev == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    return 0


if __name__ == "__main__":
    sys.exit(main())
