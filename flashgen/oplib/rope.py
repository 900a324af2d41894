"""Rotary position embedding over the query and key heads of a token, one launch for both.

Layout: q [M, Hq, D], k [M, Hkv, D]; positions [M] (int64, one per token); cos_sin [L, D] fp32 with
cos(pos * f_i) in columns [0, D/2) and sin in [D/2, D). `style` neox rotates the halves
(x[i], x[i + D/2]); gptj rotates interleaved pairs (x[2i], x[2i + 1]). The kernel domain is one row
per token and one column per rotated pair of every head, q heads first.

`rope_cache` is the decoder's form: it also stores each token's rotated k and its v at its slot
(block * block_size + offset) of a KV cache viewed as [NS, Hkv, D], updating the cache in place.

Partial rotary (`rope_partial`, `rope_cache_partial`; GPT-NeoX, Phi, GPT-J, ChatGLM): only the first R
of each head's D elements rotate, in the style's pairs within them, and the other D - R pass through;
cos_sin is [L, R], built for R (`cos_sin_cache(L, R)`). They are ops of their own, not an attr of rope,
so that every rope workload measured so far keeps its key. Each column still covers two elements: a
column past the rotated pairs copies its two pass-through elements.

Indices outside their tables are never followed: a slot outside [0, NS) (vLLM pads a batch with
slot -1) writes nothing, and a position outside [0, L) reads no cos/sin row, so its token rotates to 0.
"""
from __future__ import annotations

from flashgen.lazy import lazy

torch = lazy("torch")

from flashgen.ir.expr import Dim, Load, Ref, where
from flashgen.ir.op import DTYPE, Let, Op, Store, TensorSpec
from flashgen.oplib._common import FLOAT_DTYPES, M, c, f64, r, randn

Hq, Hkv, D, L, NS, R = Dim("Hq"), Dim("Hkv"), Dim("D"), Dim("L"), Dim("NS"), Dim("R")
HALF = D // 2


def _pairs(a, partial: bool) -> tuple:
    """This column's head h, whether it is a q or a k head, its pair index i, whether it rotates, and
    the two elements it covers. Full rope: every column rotates (`rot` is None)."""
    h, i = c // HALF, c % HALF
    half = R // 2 if partial else HALF
    i1, i2 = (i, i + half) if a["style"] == "neox" else (2 * i, 2 * i + 1)
    if not partial:
        return h, h < Hq, h >= Hq, i, None, i1, i2
    rot = i < half  # past the rotated pairs, a column copies elements 2i and 2i + 1 (both >= R)
    return h, h < Hq, h >= Hq, i, rot, where(rot, i1, 2 * i), where(rot, i2, 2 * i + 1)


def _build(a, partial: bool = False) -> tuple:
    h, is_q, is_k, i, rot, i1, i2 = _pairs(a, partial)
    pos = Load("positions", (r,))
    half = R // 2 if partial else HALF

    def both(idx):  # the element of q or of k at idx
        return Load("q", (r, h, idx), is_q) + Load("k", (r, h - Hq, idx), is_k)

    in_table = (pos >= 0) & (pos < L)  # a position past the table reads nothing: cos = sin = 0
    read = in_table if rot is None else in_table & rot
    rotated = ((i1, Ref("x1") * Ref("cos") - Ref("x2") * Ref("sin")),
               (i2, Ref("x2") * Ref("cos") + Ref("x1") * Ref("sin")))
    out = rotated if rot is None else tuple((idx, where(rot, v, Ref(x))) for (idx, v), x in zip(rotated, ("x1", "x2")))
    return (Let("cos", Load("cos_sin", (pos, i), read)), Let("sin", Load("cos_sin", (pos, i + half), read)),
            Let("x1", both(i1)), Let("x2", both(i2)),
            *(Store("q_out", (r, h, idx), v, is_q) for idx, v in out),
            *(Store("k_out", (r, h - Hq, idx), v, is_k) for idx, v in out))


def _build_cache(a, partial: bool = False) -> tuple:
    """RoPE, and each token's rotated k and its v stored at its slot of the paged cache, which the k
    columns' programs do: the decode step's cache write needs no launch of its own."""
    h, _, is_k, _, _, i1, i2 = _pairs(a, partial)
    slot, kvh = Load("slots", (r,)), h - Hq
    kept = is_k & (slot >= 0) & (slot < NS)  # a slot outside the cache (-1: padding) is not written
    rope = _build(a, partial)
    rotated = [st for st in rope if isinstance(st, Store) and st.tensor == "k_out"]
    return (*rope, *(Store("k_cache", (slot, kvh, st.indices[2]), st.value, kept) for st in rotated),
            *(Store("v_cache", (slot, kvh, idx), Load("v", (r, kvh, idx), is_k), kept) for idx in (i1, i2)))


def cos_sin_cache(max_pos: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """The [max_pos, D] fp32 table the kernel reads: cos then sin of pos * base^(-2i/D)."""
    return cos_sin_table(max_pos, base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def cos_sin_table(max_pos: int, inv_freq: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """The table for any frequencies (a scaled RoPE's), cos and sin times `scale` (YaRN's attention
    factor, which scales q and k alike)."""
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    return (torch.cat([ang.cos(), ang.sin()], dim=-1) * scale).to(torch.float32)


def _rotate(x: torch.Tensor, cs: torch.Tensor, style: str) -> torch.Tensor:
    """x with its first cs.shape[-1] elements of each head rotated, the rest as they are."""
    rot, x, rest = cs.shape[-1], x[..., :cs.shape[-1]], x[..., cs.shape[-1]:]
    half = rot // 2
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = (x[..., :half], x[..., half:]) if style == "neox" else (x[..., 0::2], x[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat([o1, o2], dim=-1) if style == "neox" else torch.stack([o1, o2], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1)


def _reference(t, p, d, a) -> dict:
    pos = t["positions"]
    cs = f64(t["cos_sin"])[pos.clamp(0, d["L"] - 1)] * ((pos >= 0) & (pos < d["L"]))[:, None]
    return {"q_out": _rotate(f64(t["q"]), cs, a["style"]), "k_out": _rotate(f64(t["k"]), cs, a["style"])}


def _inputs(d, a, g) -> dict:
    return {"q": randn((d["M"], d["Hq"], d["D"]), a["dtype"], g),
            "k": randn((d["M"], d["Hkv"], d["D"]), a["dtype"], g),
            "positions": torch.randint(0, d["L"], (d["M"],), generator=g, dtype=torch.int64),
            "cos_sin": cos_sin_cache(d["L"], d.get("R", d["D"]))}


def _reference_cache(t, p, d, a) -> dict:
    out = _reference(t, p, d, a)
    k_cache, v_cache = f64(t["k_cache"]).clone(), f64(t["v_cache"]).clone()
    kept = (t["slots"] >= 0) & (t["slots"] < d["NS"])
    k_cache[t["slots"][kept]], v_cache[t["slots"][kept]] = out["k_out"][kept], f64(t["v"])[kept]
    return {**out, "k_cache": k_cache, "v_cache": v_cache}


def _inputs_cache(d, a, g) -> dict:
    return {**_inputs(d, a, g), "v": randn((d["M"], d["Hkv"], d["D"]), a["dtype"], g),
            "slots": torch.randperm(d["NS"], generator=g)[:d["M"]],
            "k_cache": randn((d["NS"], d["Hkv"], d["D"]), a["dtype"], g),
            "v_cache": randn((d["NS"], d["Hkv"], d["D"]), a["dtype"], g)}


def _check_cache(d, a) -> str | None:
    if d["NS"] < d["M"]:
        return f"rope_cache writes each of M={d['M']} tokens to its own slot: NS={d['NS']} slots cannot hold them"
    return _check(d, a)


def _check(d, a) -> str | None:
    if d["D"] % 2:
        return f"rope needs an even head dim D, got D={d['D']}"
    if "R" in d and (d["R"] % 2 or d["R"] > d["D"]):
        return f"the rotary dim R must be even and at most the head dim D={d['D']}, got R={d['R']}"
    return None


ROPE = Op(
    name="rope", kclass="pointwise",
    doc="rotary embedding of q and k heads at per-token positions from a cos/sin cache (neox|gptj)",
    dims=("M", "Hq", "Hkv", "D", "L"), row_dims=("M",),
    inputs=(TensorSpec("q", (M, Hq, D), DTYPE), TensorSpec("k", (M, Hkv, D), DTYPE),
            TensorSpec("positions", (M,), "int64"), TensorSpec("cos_sin", (L, D), "fp32", touched=M * D)),
    outputs=(TensorSpec("q_out", (M, Hq, D), DTYPE), TensorSpec("k_out", (M, Hkv, D), DTYPE)),
    domain=(M, (Hq + Hkv) * HALF),
    attrs={"dtype": FLOAT_DTYPES, "style": ("neox", "gptj")},
    build=_build, reference=_reference, make_inputs=_inputs, check_dims=_check,
)

ROPE_CACHE = Op(
    name="rope_cache", kclass="pointwise",
    doc="rope, plus each token's rotated k and its v written to its slot of a KV cache (in place); "
        "slots outside [0, NS), such as -1 for padding, are skipped",
    dims=("M", "Hq", "Hkv", "D", "L", "NS"), row_dims=("M", "NS"), capacity_dims=("NS",),
    inputs=(*ROPE.inputs, TensorSpec("v", (M, Hkv, D), DTYPE), TensorSpec("slots", (M,), "int64"),
            TensorSpec("k_cache", (NS, Hkv, D), DTYPE, touched=M * Hkv * D, written=True),
            TensorSpec("v_cache", (NS, Hkv, D), DTYPE, touched=M * Hkv * D, written=True)),
    outputs=ROPE.outputs, domain=ROPE.domain, attrs=ROPE.attrs,
    build=_build_cache, reference=_reference_cache, make_inputs=_inputs_cache, check_dims=_check_cache,
)

ROPE_PARTIAL = Op(
    name="rope_partial", kclass="pointwise",
    doc="rope of the first R elements of each q and k head (partial rotary), the rest passed through; "
        "cos/sin cache [L, R]",
    dims=("M", "Hq", "Hkv", "D", "R", "L"), row_dims=ROPE.row_dims,
    inputs=(*ROPE.inputs[:3], TensorSpec("cos_sin", (L, R), "fp32", touched=M * R)),
    outputs=ROPE.outputs, domain=ROPE.domain, attrs=ROPE.attrs,
    build=lambda a: _build(a, partial=True), reference=_reference, make_inputs=_inputs, check_dims=_check,
)

ROPE_CACHE_PARTIAL = Op(
    name="rope_cache_partial", kclass="pointwise",
    doc="rope_partial, plus each token's rotated k and its v written to its slot of a KV cache (in place); "
        "slots outside [0, NS) are skipped",
    dims=("M", "Hq", "Hkv", "D", "R", "L", "NS"), row_dims=ROPE_CACHE.row_dims, capacity_dims=ROPE_CACHE.capacity_dims,
    inputs=(*ROPE_PARTIAL.inputs, *ROPE_CACHE.inputs[4:]),
    outputs=ROPE.outputs, domain=ROPE.domain, attrs=ROPE.attrs,
    build=lambda a: _build_cache(a, partial=True), reference=_reference_cache, make_inputs=_inputs_cache,
    check_dims=_check_cache,
)

OPS = (ROPE, ROPE_CACHE, ROPE_PARTIAL, ROPE_CACHE_PARTIAL)
