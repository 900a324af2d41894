"""Rewrites of contraction prologues into tile-shaped loads, before emission.

Written per element, a prologue reads the same memory many times over: each of the eight 4-bit codes
of a packed int32 loads its whole word, and a group scale is loaded for every k although a whole
k tile shares it. These rewrites keep the IR simple and make the generated loads tile-shaped:
- `(w[c, k // 8] >> ((k % 8) * 4)) & 15` becomes one load of the [block_k / 8, block_n] words of the
  tile, unpacked in registers by broadcasting shifts and reshaping to [block_k, block_n];
- `k // G` with G a multiple of block_k becomes `k0 // G`: one scale (or zero point) row per tile;
- a load at `[c, k // G]` with block_k a multiple of a power-of-two G becomes a Ref to the tile's
  [block_k / G, block_n] rows, loaded once and broadcast over each group (named in `grouped`).
`affine_codes` recognises `(code - zero) * scale` with zero and scale constant over each word's eight
codes, which GEMV tiles evaluate without reshaping the words (targets/triton/contraction.py).
"""
from __future__ import annotations

from typing import Mapping

from flashgen.ir import expr as E
from flashgen.ir.op import eval_int

K_TILE_START = E.Index("k0")


def _is(e: E.Expr, op: str) -> bool:
    return isinstance(e, E.Binary) and e.op == op


def packed_int4(e: E.Expr) -> E.Load | None:
    """The packed-word Load of an int4 unpack pattern over (c, k), or None."""
    if not (_is(e, "and") and e.b == E.Const(15) and _is(e.a, "shr")):
        return None
    word, shift = e.a.a, e.a.b
    if not (isinstance(word, E.Load) and len(word.indices) == 2 and word.indices[0] == E.Index("c")
            and word.indices[1] == E.Binary("floordiv", E.Index("k"), E.Const(8)) and word.mask is None):
        return None
    if shift != E.Binary("mul", E.Binary("mod", E.Index("k"), E.Const(8)), E.Const(4)):
        return None
    return word


def group_size(e: E.Load, dims: Mapping[str, int]) -> int | None:
    """G when `e` loads at [c, k // G] (a per-group scale or zero point), else None."""
    if len(e.indices) != 2 or e.indices[0] != E.Index("c") or e.mask is not None:
        return None
    ix = e.indices[1]
    if not (_is(ix, "floordiv") and ix.a == E.Index("k")):
        return None
    try:
        return eval_int(ix.b, dims)
    except ValueError:
        return None


def rewrite(e: E.Expr, dims: Mapping[str, int], block_k: int, unpacked: dict[E.Load, str],
            grouped: dict[E.Load, str]) -> E.Expr:
    """The prologue with int4 unpacks and group-wise loads replaced by Refs to tile-shaped values
    (named in `unpacked` and `grouped`, to be emitted by the caller) and tile-constant k divisions by
    divisions of the tile start."""

    def unpack(n: E.Expr) -> E.Expr:
        word = packed_int4(n)
        if word is not None and block_k % 8 == 0:
            unpacked.setdefault(word, f"codes_{word.tensor}")
            return E.Ref(unpacked[word])
        return n

    def f(n: E.Expr) -> E.Expr:
        g = group_size(n, dims) if isinstance(n, E.Load) else None
        if g is not None and g < block_k and block_k % g == 0 and g & (g - 1) == 0:
            grouped.setdefault(n, f"groups_{n.tensor}")
            return E.Ref(grouped[n])
        if _is(n, "floordiv") and n.a == E.Index("k"):
            try:
                g = eval_int(n.b, dims)
            except ValueError:
                return n
            if g % block_k == 0:
                return E.Binary("floordiv", K_TILE_START, n.b)
        return n

    return E.transform(E.transform(e, unpack), f)  # packed words first: they too are loaded at [c, k // 8]


def word_constant(e: E.Expr, dims: Mapping[str, int]) -> bool:
    """Whether `e` has one value for the eight k of each packed word: k only appears as k // G with G
    a multiple of 8."""
    if _is(e, "floordiv") and e.a == E.Index("k"):
        try:
            return eval_int(e.b, dims) % 8 == 0
        except ValueError:
            return False
    if isinstance(e, E.Index):
        return e.axis != "k"
    return all(word_constant(x, dims) for x in E.children(e))


def affine_codes(e: E.Expr, dims: Mapping[str, int]) -> tuple[E.Load, E.Expr, E.Expr | None] | None:
    """(packed word load, zero, scale) when a prologue is `(code - zero) * scale` (or without the
    scale) with zero and scale constant over each packed word's eight codes, else None. A GEMV then
    subtracts the zero point per code and scales sums of eight codes."""
    scale = None
    if _is(e, "mul") and word_constant(e.b, dims):
        e, scale = e.a, e.b
    if _is(e, "sub") and word_constant(e.b, dims):
        word = packed_int4(e.a)
        if word is not None:
            return word, e.b, scale
    return None
