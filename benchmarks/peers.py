"""The same ops written in plain torch, as engines' native fallbacks write them: the torch eager peer,
and compiled with torch.compile, the torch.compile peer. Each takes the op's inputs by name."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rmsnorm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def add_rmsnorm(x, residual, w, eps=1e-6):
    h = x.float() + residual.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return y.to(x.dtype), h.to(x.dtype)


def dynamic_quant(x):
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 127.0
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale.squeeze(-1)


def rmsnorm_quant(x, w, eps=1e-6):
    return dynamic_quant(rmsnorm(x, w, eps).float())


def silu_mul(x):
    n = x.shape[-1] // 2
    return F.silu(x[:, :n]) * x[:, n:]


def _rotate_neox(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rope(q, k, positions, cos_sin):
    cos, sin = cos_sin[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate_neox(q, cos, sin), _rotate_neox(k, cos, sin)


PEERS = {"rmsnorm": rmsnorm, "add_rmsnorm": add_rmsnorm, "dynamic_quant": dynamic_quant,
         "rmsnorm_quant": rmsnorm_quant, "silu_mul": silu_mul, "rope": rope}
