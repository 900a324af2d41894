"""Rewrites of contraction prologues into tile-shaped loads, before emission.

Written per element, a prologue reads the same memory many times over: each of the eight 4-bit codes
of a packed int32 loads its whole word, and a group scale is loaded for every k although a whole
k tile shares it. These rewrites keep the IR simple and make the generated loads tile-shaped:
- `(w[c, k // 8] >> ((k % 8) * 4)) & 15` becomes one load of the [block_k / 8, block_n] words of the
  tile, unpacked in registers by broadcasting shifts and reshaping to [block_k, block_n];
- `k // G` with G a multiple of block_k becomes `k0 // G`: one scale (or zero point) row per tile.
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


def rewrite(e: E.Expr, dims: Mapping[str, int], block_k: int, unpacked: dict[E.Load, str]) -> E.Expr:
    """The prologue with int4 unpacks replaced by Refs to tile-unpacked values (named in `unpacked`,
    to be emitted by the caller) and tile-constant k divisions by divisions of the tile start."""

    def f(n: E.Expr) -> E.Expr:
        word = packed_int4(n)
        if word is not None and block_k % 8 == 0:
            unpacked.setdefault(word, f"codes_{word.tensor}")
            return E.Ref(unpacked[word])
        if _is(n, "floordiv") and n.a == E.Index("k"):
            try:
                g = eval_int(n.b, dims)
            except ValueError:
                return n
            if g % block_k == 0:
                return E.Binary("floordiv", K_TILE_START, n.b)
        return n

    return E.transform(e, f)
