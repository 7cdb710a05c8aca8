#!/usr/bin/env python3
"""torch_moe.py -- the model of bench/train_cpu.c in PyTorch, timed the same way.

The architecture of tinymoe's default tm_model_config, written the way a PyTorch user would
(Mixtral / Hugging Face style), so the comparison is against idiomatic eager PyTorch:
  tokens -> embedding -> n_layers x [x += attn(rmsnorm(x)); x += moe(rmsnorm(x))]
         -> rmsnorm -> lm_head (untied) -> logits
  attn: causal, grouped-query heads, rotary embeddings (rotate-half, theta 10000), no biases,
        through F.scaled_dot_product_attention(is_causal=True) (torch 1.13: its private
        predecessor F._scaled_dot_product_attention; --attn manual writes it out)
  moe:  linear gate -> softmax over all experts -> top-2 (weights not renormalised), a loop
        over experts gathering their tokens (index_select), SwiGLU expert, weighted
        index_add_ back; Switch load-balancing aux loss
          aux = E * coeff / (k * T^2) * sum_e (sum_t scores[t, e]) * tokens_per_expert[e]
  loss: mean cross-entropy + coeff-weighted aux losses
A step: forward, backward, clip_grad_norm_(1.0), AdamW (weight decay 0.1 on >= 2-D
parameters, lr 1e-3), zero_grad. Random tokens; warm-up steps, then timed steps.

Output: a human line, then one machine-readable line
  RESULT impl=pytorch tokens_per_s=... ms_per_step=... params=... threads=... steps=... ...
"""
import argparse
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Config:
    vocab_size = 257
    d_model = 128
    n_layers = 4
    n_heads = 4
    n_kv_heads = 4
    rope_theta = 10000.0
    norm_eps = 1e-5
    num_experts = 4
    topk = 2
    ffn_size = 256
    aux_loss_coeff = 1e-2
    init_std = 0.02
    attn = "sdpa"  # or "manual": softmax(q k^T / sqrt(D) + causal mask) v written out


class RMSNorm(nn.Module):
    # torch 1.13 has no nn.RMSNorm (it arrived in 2.4).
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq, head_dim, theta):
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)  # (T, D/2)
    ang = torch.cat([ang, ang], dim=-1)                                  # (T, D)
    return ang.cos().float(), ang.sin().float()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def causal_attention(q, k, v, impl):
    # q (B, Hq, T, D), k and v (B, Hkv, T, D)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if impl == "sdpa":
        if hasattr(F, "scaled_dot_product_attention"):  # torch >= 2.0
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # torch 1.13 (Debian's) has it under a private name, returning (out, weights).
        return F._scaled_dot_product_attention(q, k, v, None, 0.0, False, True)[0]
    T = q.shape[2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v


def has_sdpa():
    return hasattr(F, "scaled_dot_product_attention") or hasattr(F, "_scaled_dot_product_attention")


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.impl = c.attn
        self.h, self.hkv, self.d = c.n_heads, c.n_kv_heads, c.d_model // c.n_heads
        self.wq = nn.Linear(c.d_model, self.h * self.d, bias=False)
        self.wk = nn.Linear(c.d_model, self.hkv * self.d, bias=False)
        self.wv = nn.Linear(c.d_model, self.hkv * self.d, bias=False)
        self.wo = nn.Linear(self.h * self.d, c.d_model, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.h, self.d).transpose(1, 2)    # (B, Hq, T, D)
        k = self.wk(x).view(B, T, self.hkv, self.d).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = causal_attention(q, k, v, self.impl).transpose(1, 2).reshape(B, T, self.h * self.d)
        return self.wo(y)


class MoE(nn.Module):
    def __init__(self, c):
        super().__init__()
        H, F_, E = c.d_model, c.ffn_size, c.num_experts
        self.E, self.k, self.coeff = E, c.topk, c.aux_loss_coeff
        self.gate = nn.Linear(H, E, bias=False)
        self.w0 = nn.Parameter(torch.empty(E, H, F_))  # gate projection of SwiGLU
        self.w1 = nn.Parameter(torch.empty(E, H, F_))  # up projection
        self.wo = nn.Parameter(torch.empty(E, F_, H))  # down projection

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])                              # (N, H)
        N = x.shape[0]
        scores = self.gate(x).float().softmax(dim=-1)             # (N, E)
        probs, idx = scores.topk(self.k, dim=-1)                  # (N, k)
        counts = torch.bincount(idx.flatten(), minlength=self.E)  # (E,)
        aux = self.E * self.coeff / (self.k * N * N) * (scores.sum(0) * counts.to(scores.dtype)).sum()
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, slot = torch.where(idx == e)
            if tok.numel() == 0:
                continue
            xe = x.index_select(0, tok)                                        # (n_e, H)
            ye = (F.silu(xe @ self.w0[e]) * (xe @ self.w1[e])) @ self.wo[e]    # (n_e, H)
            out.index_add_(0, tok, ye * probs[tok, slot].unsqueeze(-1).to(ye.dtype))
        return out.view(shape), aux


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attn = Attention(c)
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.moe = MoE(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        y, aux = self.moe(self.ffn_norm(x))
        return x + y, aux


class Model(nn.Module):
    def __init__(self, c, seq):
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        cos, sin = rope_tables(seq, c.d_model // c.n_heads, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # As tinymoe: N(0, std), residual output projections std / sqrt(2 n_layers).
        std, out_std = c.init_std, c.init_std / math.sqrt(2 * c.n_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            nn.init.normal_(p, 0.0, out_std if name.endswith(("attn.wo.weight", "moe.wo")) else std)

    def forward(self, tokens, targets):
        T = tokens.shape[1]
        x = self.embed(tokens)
        aux_total = 0.0
        for layer in self.layers:
            x, aux = layer(x, self.cos[:T], self.sin[:T])
            aux_total = aux_total + aux
        logits = self.lm_head(self.norm(x))
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return ce + aux_total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--attn", choices=["sdpa", "manual"], default="sdpa" if has_sdpa() else "manual",
                    help="attention: (torch's fused) scaled_dot_product_attention, or written out")
    a = ap.parse_args()
    if min(a.threads, a.batch, a.seq, a.steps) < 1 or a.warmup < 0:
        ap.error("threads, batch, seq, steps must be >= 1 and warmup >= 0")

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    c = Config()
    c.attn = a.attn
    model = Model(c, a.seq)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.999), eps=1e-8)

    B, T = a.batch, a.seq
    t0, loss_v = 0.0, float("nan")
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            t0 = time.perf_counter()
        rows = torch.randint(0, c.vocab_size, (B, T + 1))
        loss = model(rows[:, :-1], rows[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_v = loss.item()
    dt = time.perf_counter() - t0
    tok_s = B * T * a.steps / dt
    ms = 1e3 * dt / a.steps
    print(f"pytorch {torch.__version__}: {n_params} params, B={B} T={T}, {a.threads} threads, "
          f"attention {a.attn}, {a.warmup} warm-up + {a.steps} timed steps: {tok_s:.1f} tokens/s, {ms:.1f} ms/step, "
          f"final loss {loss_v:.4f}")
    print(f"RESULT impl=pytorch tokens_per_s={tok_s:.1f} ms_per_step={ms:.2f} params={n_params} "
          f"threads={a.threads} steps={a.steps} batch={B} seq={T} loss={loss_v:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
