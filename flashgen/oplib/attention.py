"""Attention ops.

paged_decode_attention: one new query token per sequence against a paged KV cache.

Cache layout: k_cache and v_cache are [NB, BS, Hkv, D] — NB physical blocks of BS tokens; the tokens
of sequence b live in blocks block_tables[b, 0], block_tables[b, 1], ..., in order, and the first
context_lens[b] positions are valid. q is [B, Hq, D]; query head h reads KV head h // (Hq / Hkv) (GQA).
The query sits at position context_lens[b] - 1. A sequence's other slots (the rest of its last block,
the blocks its table is padded with) may hold anything, another request's values or NaN and inf
included: no attention op lets them, or a packed batch's rows outside a sequence, change that
sequence's output (kernels mask them by selection; the references slice them away).

Head dims D are multiples of 8 from 16 to 256 (64, 80, 96, 112, 128, 192, 256 of the Llama, Qwen,
Phi and Gemma families), powers of two or not. With kv=fp8e4m3 the cache holds e4m3 values with per-tensor scales (k_scale, v_scale: the cached value times its scale is the key or value). Logits are q·k / sqrt(D), then the `mod`:
- window: keys more than `window` positions back are masked;
- softcap: logits become softcap · tanh(logit / softcap);
- alibi: logits get alibi_slopes[h] · (kpos - qpos).
Dims NB, MAXB (block table width) and L (the longest context, for the roofline) are run-time: one
kernel serves any cache size and batch.
"""
from __future__ import annotations

from flashgen.lazy import lazy

torch = lazy("torch")

from flashgen.ir.expr import Dim, Index, Load, Param, Ref, tanh
from flashgen.ir.op import DTYPE, Attend, Op, TensorSpec
from flashgen.oplib._common import f64, randn

B, Hq, Hkv, D, BS, NB, MAXB, L = (Dim(n) for n in ("B", "Hq", "Hkv", "D", "BS", "NB", "MAXB", "L"))
S, H, QPOS, KPOS = Ref("s"), Index("h"), Index("qpos"), Index("kpos")
MODS = ("none", "window", "softcap", "alibi")
ALIBI = TensorSpec("alibi_slopes", (Hq,), "fp32", when=(("mod", ("alibi",)),))


def _mods(a) -> tuple:
    """(score, mask) of the `mod` attr, on top of causal masking."""
    score, mask = S, KPOS <= QPOS
    if a["mod"] == "window":
        mask = mask & (KPOS > QPOS - Param("window"))
    elif a["mod"] == "softcap":
        score = Param("softcap") * tanh(S / Param("softcap"))
    elif a["mod"] == "alibi":
        score = S + Load("alibi_slopes", (H,)) * (KPOS - QPOS)
    return score, mask


def _build(a) -> tuple:
    return (Attend(*_mods(a), kind="decode"),)


MAX_HEAD_DIM = 256  # the widest head of the usual families (Gemma); wider tiles leave no registers
REFERENCE_SCORES = 1 << 27  # float64 scores the reference holds at once


def _attend(q, k, v, qpos, kpos, t, p, a) -> torch.Tensor:
    """float64 attention of queries q [n, Hq, D] at positions qpos [n] over keys and values [m, Hq, D] at
    kpos [m], causal, with the `mod`: the reference every attention op is checked against. Queries go in
    chunks so the float64 scores stay near 1 GiB (one 16k-token sequence would need 69 GB at once)."""
    rows = max(1, REFERENCE_SCORES // (q.shape[1] * k.shape[0]))
    if q.shape[0] > rows:
        return torch.cat([_attend(q[i:i + rows], k, v, qpos[i:i + rows], kpos, t, p, a)
                          for i in range(0, q.shape[0], rows)])
    s = torch.einsum("ihd,jhd->hij", q, k) / q.shape[-1] ** 0.5
    if a["mod"] == "softcap":
        s = p["softcap"] * torch.tanh(s / p["softcap"])
    elif a["mod"] == "alibi":
        s = s + f64(t["alibi_slopes"])[:, None, None] * (kpos[None, :] - qpos[:, None])[None]
    mask = kpos[None, :] <= qpos[:, None]
    if a["mod"] == "window":
        mask &= kpos[None, :] > qpos[:, None] - p["window"]
    return torch.einsum("hij,jhd->ihd", torch.softmax(s.masked_fill(~mask[None], float("-inf")), dim=-1), v)


def _reference(t, p, d, a) -> dict:
    fp8 = a["kv"] != "same"  # the scales belong to an fp8 cache; a cache of the query's dtype holds the values
    q, kc, vc = (f64(t["q"]), f64(t["k_cache"]) * (p["k_scale"] if fp8 else 1.0),
                 f64(t["v_cache"]) * (p["v_scale"] if fp8 else 1.0))
    group = d["Hq"] // d["Hkv"]
    out = torch.empty_like(q)
    for b in range(d["B"]):
        n = int(t["context_lens"][b])
        blocks = t["block_tables"][b, : -(-n // d["BS"])].long()
        k = kc[blocks].reshape(-1, d["Hkv"], d["D"])[:n].repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = vc[blocks].reshape(-1, d["Hkv"], d["D"])[:n].repeat_interleave(group, dim=1)
        pos = torch.arange(n, dtype=torch.float64, device=q.device)
        out[b] = _attend(q[b][None], k, v, pos[-1:], pos, t, p, a)[0]
    return {"out": out}


def _inputs(d, a, g) -> dict:
    b, bs, maxb = d["B"], d["BS"], d["MAXB"]
    lens = torch.randint(1, d["L"] + 1, (b,), generator=g, dtype=torch.int32)
    lens[0] = d["L"]  # the longest context is always present
    nb = d["NB"]
    tables = _tables(b, nb, maxb, g)
    kv = a["dtype"] if a["kv"] == "same" else a["kv"]
    t = {"q": randn((b, d["Hq"], d["D"]), a["dtype"], g),
         "k_cache": randn((nb, bs, d["Hkv"], d["D"]), kv, g),
         "v_cache": randn((nb, bs, d["Hkv"], d["D"]), kv, g),
         "block_tables": tables, "context_lens": lens}
    return _with_alibi(t, d, a)


def _with_alibi(t: dict, d, a) -> dict:
    """The ALiBi slopes of the usual geometric series, when the mod asks for them."""
    if a["mod"] == "alibi":
        t["alibi_slopes"] = 2.0 ** (-8.0 * torch.arange(1, d["Hq"] + 1, dtype=torch.float32) / d["Hq"])
    return t


def _tables(b: int, nb: int, maxb: int, g: torch.Generator) -> torch.Tensor:
    """Block tables of random distinct blocks (repeating only when a table is wider than the cache)."""
    return torch.stack([torch.randperm(nb, generator=g).repeat(-(-maxb // nb))[:maxb] for _ in range(b)]).to(torch.int32)


def _cache_check(d) -> str | None:
    """Rules of the paged cache's dims, shared by the ops that read it."""
    if d["BS"] & (d["BS"] - 1) or d["BS"] < 16:
        return f"block size BS={d['BS']} must be a power of two, at least 16"
    return None  # NB < MAXB is fine: a runtime pads its tables to one width


def _head_dim_check(d) -> str | None:
    """Head dims the kernels take: multiples of 8 (16-byte rows of 16-bit values, as vector loads and TMA
    copies want) from 16 to MAX_HEAD_DIM; one that is not a power of two runs in tiles padded to the next."""
    if d["D"] % 8 or not 16 <= d["D"] <= MAX_HEAD_DIM:
        return f"head dim D={d['D']} must be a multiple of 8 from 16 to {MAX_HEAD_DIM}"
    return None


def _check(d, a) -> str | None:
    if d["Hq"] % d["Hkv"]:
        return f"Hq={d['Hq']} must be a multiple of Hkv={d['Hkv']}"
    if d["MAXB"] * d["BS"] < d["L"]:
        return f"a block table of MAXB={d['MAXB']} blocks of BS={d['BS']} cannot hold L={d['L']} tokens"
    return _head_dim_check(d) or _cache_check(d)


PAGED_DECODE = Op(
    name="paged_decode_attention", kclass="attention",
    doc="one query token per sequence against a paged KV cache (bf16/fp16, or fp8 e4m3 with scales); GQA; "
        "head dims 16-256 (multiples of 8); mods window|softcap|alibi",
    dims=("B", "Hq", "Hkv", "D", "BS", "NB", "MAXB", "L"), row_dims=("B", "NB", "MAXB", "L"),
    capacity_dims=("NB", "MAXB"),
    inputs=(TensorSpec("q", (B, Hq, D), DTYPE),
            TensorSpec("k_cache", (NB, BS, Hkv, D), "$kv", touched=B * L * Hkv * D),
            TensorSpec("v_cache", (NB, BS, Hkv, D), "$kv", touched=B * L * Hkv * D),
            TensorSpec("block_tables", (B, MAXB), "int32"), TensorSpec("context_lens", (B,), "int32"), ALIBI),
    outputs=(TensorSpec("out", (B, Hq, D), DTYPE),),
    domain=(B, Hkv), attrs={"dtype": ("bf16", "fp16"), "mod": MODS, "kv": ("same", "fp8e4m3")},
    params={"window": 1024.0, "softcap": 30.0, "k_scale": 1.0, "v_scale": 1.0},
    build=_build, reference=_reference, make_inputs=_inputs, check_dims=_check,
)


# ---- flash_prefill_attention -------------------------------------------------------------------
T = Dim("T")


def _prefill_reference(t, p, d, a) -> dict:
    q, k, v = f64(t["q"]), f64(t["k"]), f64(t["v"])
    group = d["Hq"] // d["Hkv"]
    out = torch.empty_like(q)
    cu = t["cu_seqlens"].tolist()
    for b in range(len(cu) - 1):
        s0, s1 = cu[b], cu[b + 1]
        n = s1 - s0
        if n == 0:
            continue
        kk, vv = k[s0:s1].repeat_interleave(group, 1), v[s0:s1].repeat_interleave(group, 1)
        pos = torch.arange(n, dtype=torch.float64, device=q.device)
        out[s0:s1] = _attend(q[s0:s1], kk, vv, pos, pos, t, p, a)
    return {"out": out}


def _prefill_inputs(d, a, g) -> dict:
    """B sequences of random lengths summing to T (some may be 1 token long)."""
    b, total = d["B"], d["T"]
    cuts = torch.sort(torch.randperm(total - 1, generator=g)[: b - 1] + 1).values if b > 1 else torch.zeros(0, dtype=torch.long)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), cuts, torch.tensor([total])]).to(torch.int32)
    t = {"q": randn((total, d["Hq"], d["D"]), a["dtype"], g), "k": randn((total, d["Hkv"], d["D"]), a["dtype"], g),
         "v": randn((total, d["Hkv"], d["D"]), a["dtype"], g), "cu_seqlens": cu}
    return _with_alibi(t, d, a)


def _prefill_check(d, a) -> str | None:
    if d["Hq"] % d["Hkv"]:
        return f"Hq={d['Hq']} must be a multiple of Hkv={d['Hkv']}"
    if msg := _head_dim_check(d):
        return msg
    if d["B"] > d["T"]:
        return f"B={d['B']} sequences cannot share T={d['T']} tokens"
    return None


# Packed new tokens of B sequences (cu_seqlens [B + 1] marks where each starts; rows past cu_seqlens[B], if
# any, are padding) and the optional slopes.
PACKED = (TensorSpec("q", (T, Hq, D), DTYPE), TensorSpec("k", (T, Hkv, D), DTYPE),
          TensorSpec("v", (T, Hkv, D), DTYPE), TensorSpec("cu_seqlens", (B + 1,), "int32"))
FLASH_PREFILL = Op(
    name="flash_prefill_attention", kclass="attention",
    doc="causal attention over packed variable-length sequences (cu_seqlens); GQA; head dims 16-256 "
        "(multiples of 8); mods window|softcap|alibi",
    dims=("T", "B", "Hq", "Hkv", "D"), row_dims=("T", "B"),
    inputs=(*PACKED, ALIBI),
    outputs=(TensorSpec("out", (T, Hq, D), DTYPE),),
    domain=(T, Hq), attrs={"dtype": ("bf16", "fp16"), "mod": MODS},
    params={"window": 1024.0, "softcap": 30.0},
    build=lambda a: (Attend(*_mods(a), kind="prefill"),),
    reference=_prefill_reference, make_inputs=_prefill_inputs, check_dims=_prefill_check,
)


# ---- chunked_prefill_attention: new tokens after a prefix already in the paged cache ---------------
def _chunked_reference(t, p, d, a) -> dict:
    """Each sequence's queries sit after its cached prefix: they see the whole prefix and the new
    tokens causally."""
    q, k, v = f64(t["q"]), f64(t["k"]), f64(t["v"])
    kc, vc = f64(t["k_cache"]), f64(t["v_cache"])
    group = d["Hq"] // d["Hkv"]
    out = torch.empty_like(q)
    cu = t["cu_seqlens"].tolist()
    for b in range(len(cu) - 1):
        s0, s1, pre = cu[b], cu[b + 1], int(t["prefix_lens"][b])
        n = s1 - s0
        if n == 0:
            continue
        blocks = t["block_tables"][b, : -(-pre // d["BS"])].long()
        kp = kc[blocks].reshape(-1, d["Hkv"], d["D"])[:pre]
        vp = vc[blocks].reshape(-1, d["Hkv"], d["D"])[:pre]
        kk = torch.cat([kp, k[s0:s1]]).repeat_interleave(group, 1)
        vv = torch.cat([vp, v[s0:s1]]).repeat_interleave(group, 1)
        kpos = torch.arange(pre + n, dtype=torch.float64, device=q.device)
        out[s0:s1] = _attend(q[s0:s1], kk, vv, kpos[pre:], kpos, t, p, a)
    return {"out": out}


def _chunked_inputs(d, a, g) -> dict:
    t = _prefill_inputs(d, a, g)
    nb, bs, maxb = d["NB"], d["BS"], d["MAXB"]
    t["k_cache"] = randn((nb, bs, d["Hkv"], d["D"]), a["dtype"], g)
    t["v_cache"] = randn((nb, bs, d["Hkv"], d["D"]), a["dtype"], g)
    t["block_tables"] = _tables(d["B"], d["NB"], d["MAXB"], g)
    pre = torch.randint(0, maxb * bs + 1, (d["B"],), generator=g, dtype=torch.int32)
    pre[0] = 0  # a sequence with no prefix: plain prefill
    t["prefix_lens"] = pre
    return t


def _chunked_check(d, a) -> str | None:
    return _prefill_check(d, a) or _cache_check(d)


CHUNKED_PREFILL = Op(
    name="chunked_prefill_attention", kclass="attention",
    doc="prefill of packed new tokens after per-sequence prefixes already in a paged KV cache "
        "(chunked prefill, prompt-cache reuse); GQA; head dims 16-256 (multiples of 8); mods",
    dims=("T", "B", "Hq", "Hkv", "D", "BS", "NB", "MAXB"), row_dims=("T", "B", "NB", "MAXB"),
    capacity_dims=("NB", "MAXB"),
    inputs=(*PACKED, TensorSpec("k_cache", (NB, BS, Hkv, D), DTYPE, touched=B * MAXB * BS * Hkv * D),
            TensorSpec("v_cache", (NB, BS, Hkv, D), DTYPE, touched=B * MAXB * BS * Hkv * D),
            TensorSpec("block_tables", (B, MAXB), "int32"), TensorSpec("prefix_lens", (B,), "int32"), ALIBI),
    outputs=(TensorSpec("out", (T, Hq, D), DTYPE),),
    domain=(T, Hq), attrs={"dtype": ("bf16", "fp16"), "mod": MODS},
    params={"window": 1024.0, "softcap": 30.0},
    build=lambda a: (Attend(*_mods(a), kind="prefill"),),
    reference=_chunked_reference, make_inputs=_chunked_inputs, check_dims=_chunked_check,
)

OPS = (PAGED_DECODE, FLASH_PREFILL, CHUNKED_PREFILL)
