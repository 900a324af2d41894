"""Attention ops. paged_decode_attention: one new query token per sequence against a paged KV cache.

Cache layout: k_cache and v_cache are [NB, BS, Hkv, D] — NB physical blocks of BS tokens; the tokens
of sequence b live in blocks block_tables[b, 0], block_tables[b, 1], ..., in order, and the first
context_lens[b] positions are valid. q is [B, Hq, D]; query head h reads KV head h // (Hq / Hkv) (GQA).
The query sits at position context_lens[b] - 1. Logits are q·k / sqrt(D), then the `mod`:
- window: keys more than `window` positions back are masked;
- softcap: logits become softcap · tanh(logit / softcap);
- alibi: logits get alibi_slopes[h] · (kpos - qpos).
Dims NB, MAXB (block table width) and L (the longest context, for the roofline) are run-time: one
kernel serves any cache size and batch.
"""
from __future__ import annotations

import torch

from flashgen.ir.expr import Dim, Index, Load, Param, Ref, tanh
from flashgen.ir.op import DTYPE, Attend, Op, TensorSpec
from flashgen.oplib._common import f64, randn

B, Hq, Hkv, D, BS, NB, MAXB, L = (Dim(n) for n in ("B", "Hq", "Hkv", "D", "BS", "NB", "MAXB", "L"))
S, H, QPOS, KPOS = Ref("s"), Index("h"), Index("qpos"), Index("kpos")
MODS = ("none", "window", "softcap", "alibi")


def _build(a) -> tuple:
    score, mask = S, KPOS <= QPOS
    if a["mod"] == "window":
        mask = KPOS > QPOS - Param("window")
    elif a["mod"] == "softcap":
        score = Param("softcap") * tanh(S / Param("softcap"))
    elif a["mod"] == "alibi":
        score = S + Load("alibi_slopes", (H,)) * (KPOS - QPOS)
    return (Attend(score, mask),)


def _reference(t, p, d, a) -> dict:
    q, kc, vc = f64(t["q"]), f64(t["k_cache"]), f64(t["v_cache"])
    group = d["Hq"] // d["Hkv"]
    out = torch.empty_like(q)
    for b in range(d["B"]):
        n = int(t["context_lens"][b])
        blocks = t["block_tables"][b, : -(-n // d["BS"])].long()
        k = kc[blocks].reshape(-1, d["Hkv"], d["D"])[:n].repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = vc[blocks].reshape(-1, d["Hkv"], d["D"])[:n].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b], k) / d["D"] ** 0.5
        kpos, qpos = torch.arange(n, dtype=torch.float64), n - 1
        if a["mod"] == "softcap":
            s = p["softcap"] * torch.tanh(s / p["softcap"])
        elif a["mod"] == "alibi":
            s = s + f64(t["alibi_slopes"])[:, None] * (kpos - qpos)[None, :]
        elif a["mod"] == "window":
            s = s.masked_fill(~(kpos > qpos - p["window"])[None, :], float("-inf"))
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return {"out": out}


def _inputs(d, a, g) -> dict:
    b, bs, maxb = d["B"], d["BS"], d["MAXB"]
    lens = torch.randint(1, d["L"] + 1, (b,), generator=g, dtype=torch.int32)
    lens[0] = d["L"]  # the longest context is always present
    nb = d["NB"]
    tables = torch.stack([torch.randperm(nb, generator=g)[:maxb] for _ in range(b)]).to(torch.int32)
    t = {"q": randn((b, d["Hq"], d["D"]), a["dtype"], g),
         "k_cache": randn((nb, bs, d["Hkv"], d["D"]), a["dtype"], g),
         "v_cache": randn((nb, bs, d["Hkv"], d["D"]), a["dtype"], g),
         "block_tables": tables, "context_lens": lens}
    if a["mod"] == "alibi":
        t["alibi_slopes"] = 2.0 ** (-8.0 * torch.arange(1, d["Hq"] + 1, dtype=torch.float32) / d["Hq"])
    return t


def _check(d, a) -> str | None:
    if d["Hq"] % d["Hkv"]:
        return f"Hq={d['Hq']} must be a multiple of Hkv={d['Hkv']}"
    if d["MAXB"] * d["BS"] < d["L"]:
        return f"a block table of MAXB={d['MAXB']} blocks of BS={d['BS']} cannot hold L={d['L']} tokens"
    if d["NB"] < d["MAXB"]:
        return f"the cache has NB={d['NB']} blocks, fewer than one table's MAXB={d['MAXB']}"
    if d["D"] & (d["D"] - 1) or d["D"] < 16 or d["BS"] & (d["BS"] - 1) or d["BS"] < 16:
        return f"head dim D={d['D']} and block size BS={d['BS']} must be powers of two, at least 16"
    return None


PAGED_DECODE = Op(
    name="paged_decode_attention", kclass="attention",
    doc="one query token per sequence against a paged KV cache; GQA; mods window|softcap|alibi",
    dims=("B", "Hq", "Hkv", "D", "BS", "NB", "MAXB", "L"), row_dims=("B", "NB", "MAXB", "L"),
    inputs=(TensorSpec("q", (B, Hq, D), DTYPE),
            TensorSpec("k_cache", (NB, BS, Hkv, D), DTYPE, touched=B * L * Hkv * D),
            TensorSpec("v_cache", (NB, BS, Hkv, D), DTYPE, touched=B * L * Hkv * D),
            TensorSpec("block_tables", (B, MAXB), "int32"), TensorSpec("context_lens", (B,), "int32"),
            TensorSpec("alibi_slopes", (Hq,), "fp32", when=(("mod", ("alibi",)),))),
    outputs=(TensorSpec("out", (B, Hq, D), DTYPE),),
    domain=(B, Hkv), attrs={"dtype": ("bf16", "fp16"), "mod": MODS},
    params={"window": 1024.0, "softcap": 30.0},
    build=_build, reference=_reference, make_inputs=_inputs, check_dims=_check,
)

OPS = (PAGED_DECODE,)
