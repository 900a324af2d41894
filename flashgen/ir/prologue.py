"""Rewrites of contraction prologues into tile-shaped loads, before emission.

Written per element, a prologue reads the same memory many times over: each of the eight 4-bit codes
of a packed int32 loads its whole word, and a group scale is loaded for every k although a whole
k tile shares it. These rewrites keep the IR simple and make the generated loads tile-shaped:
- an int4 code of the packed layout (`int4_code`, flashgen/quant.py) becomes one load of the
  [block_k / 8, block_n] words of the tile, unpacked in registers by broadcasting shifts and reshaping
  to [block_k, block_n];
- `k // G` with G a multiple of block_k becomes `k0 // G`: one scale (or zero point) row per tile;
- a load at `[c, k // G]` with block_k a multiple of a power-of-two G becomes a Ref to the tile's
  [block_k / G, block_n] rows, loaded once and broadcast over each group (named in `grouped`).
`affine_codes` recognises `(code - zero) * scale` with zero and scale constant over each run of sixteen
consecutive k, which GEMV and matrix tiles evaluate without reshaping the words, code j of sixteen
words at a time (targets/triton/contraction.py); the reshape above serves other int4 prologues.
"""
from __future__ import annotations

import math
from typing import Mapping

from flashgen.ir import expr as E
from flashgen.ir.op import eval_int
from flashgen.quant import INT4_PERIOD, LANE_BLOCK

RUN = INT4_PERIOD // 8  # consecutive k held by one code position of consecutive words

K_TILE_START = E.Index("k0")


def _is(e: E.Expr, op: str) -> bool:
    return isinstance(e, E.Binary) and e.op == op


def int4_code(tensor: str, row: tuple[E.Expr, ...] = (E.Index("c"),)) -> E.Expr:
    """The code at (row, k) of an int4 weight packed by `pack_int4`: word 16*(k // 128) + k % 16,
    bits 4*((k % 128) // 16) and up. `row` indexes every axis before the words' (a stack of weights,
    as the moe class's experts [e, c, words], adds its own)."""
    k = E.Index("k")
    word = E.Load(tensor, (*row, k // INT4_PERIOD * RUN + k % RUN))
    return (word >> (k % INT4_PERIOD // RUN * 4)) & 15


def _free_of_k(indices: tuple[E.Expr, ...]) -> bool:
    return not any(isinstance(n, E.Index) and n.axis in ("k", "k0") for ix in indices for n in E.walk(ix))


def int4_lane(tensor: str) -> E.Expr:
    """The signed code u - 8 at (c, k) of an int4 weight packed by `pack_int4_lanes` (flashgen/quant.py):
    word 4*(k // 32) + (k % 16) // 4, byte k % 4, its high nibble for k % 32 < 16, else its low one;
    the nibble n read as 4-bit two's complement, n - 2 * (n & 8). Per element this is the layout's
    meaning (and what the generic tiles and the dequant evaluate); the `lanes` matrix tiles read four
    k of it with one AND (targets/triton/contraction/int8_lanes.py)."""
    k = E.Index("k")
    block = LANE_BLOCK // 2  # k per nibble half of a block
    word = E.Load(tensor, (E.Index("c"), k // LANE_BLOCK * 4 + k % block // 4))
    nibble = (word >> (k % 4 * 8 + 4 - k % LANE_BLOCK // block * 4)) & 15
    return nibble - (nibble & 8) * 2


def lane_words(e: E.Expr) -> E.Load | None:
    """The packed-word Load of a `lanes` code over (c, k) (`int4_lane`), or None."""
    loads = list({n for n in E.walk(e) if isinstance(n, E.Load)})
    return loads[0] if len(loads) == 1 and e == int4_lane(loads[0].tensor) else None


def packed_int4(e: E.Expr) -> E.Load | None:
    """The packed-word Load of an int4 code over (c, k), or None."""
    if not (_is(e, "and") and _is(e.a, "shr") and isinstance(e.a.a, E.Load)):
        return None
    word = e.a.a
    row = word.indices[:-1]
    return word if word.mask is None and _free_of_k(row) and e == int4_code(word.tensor, row) else None


def group_size(e: E.Load, dims: Mapping[str, int]) -> int | None:
    """G when `e` loads at [row, k // G] (a per-group scale or zero point; the row's indices free of
    k), else None."""
    if len(e.indices) < 2 or not _free_of_k(e.indices[:-1]) or e.mask is not None:
        return None
    ix = e.indices[-1]
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
    divisions of the tile start. The dicts may be shared by several prologues (the moe class's gate
    and up rows of one weight): a second load of a tensor is named apart, with a suffix."""

    def name(names: dict[E.Load, str], load: E.Load, base: str) -> str:
        if load not in names:
            taken, i = set(names.values()), 0
            while (base if i == 0 else f"{base}_{i}") in taken:
                i += 1
            names[load] = base if i == 0 else f"{base}_{i}"
        return names[load]

    def unpack(n: E.Expr) -> E.Expr:
        word = packed_int4(n)
        if word is not None and block_k % INT4_PERIOD == 0:
            return E.Ref(name(unpacked, word, f"codes_{word.tensor}"))
        return n

    def f(n: E.Expr) -> E.Expr:
        g = group_size(n, dims) if isinstance(n, E.Load) else None
        if g is not None and g < block_k and block_k % g == 0 and g & (g - 1) == 0:
            return E.Ref(name(grouped, n, f"groups_{n.tensor}"))
        if _is(n, "floordiv") and n.a == E.Index("k"):
            try:
                g = eval_int(n.b, dims)
            except ValueError:
                return n
            if g % block_k == 0:
                return E.Binary("floordiv", K_TILE_START, n.b)
        return n

    return E.transform(E.transform(e, unpack), f)  # packed words first: their index divides k too


def k_period(e: E.Expr, dims: Mapping[str, int]) -> int | None:
    """The longest aligned run of k over which `e` keeps one value: the gcd of every G in `k // G`
    (None when k does not appear; 1 when k appears otherwise)."""
    if _is(e, "floordiv") and e.a == E.Index("k"):
        try:
            return eval_int(e.b, dims)
        except ValueError:
            return 1
    if isinstance(e, E.Index):
        return 1 if e.axis == "k" else None
    periods = [p for p in (k_period(x, dims) for x in E.children(e)) if p is not None]
    return math.gcd(*periods) if periods else None


def affine_codes(e: E.Expr, dims: Mapping[str, int]) -> tuple[E.Load, E.Expr, E.Expr | None] | None:
    """(packed word load, zero, scale) when a prologue is `(code - zero) * scale` (or without the
    scale) with zero and scale constant over each aligned run of RUN consecutive k, else None. Tiles
    then subtract the zero point and apply the scale once per run of codes, not per code."""
    def run_constant(x: E.Expr) -> bool:
        p = k_period(x, dims)
        return p is None or p % RUN == 0

    scale = None
    if _is(e, "mul") and run_constant(e.b):
        e, scale = e.a, e.b
    if _is(e, "sub") and run_constant(e.b):
        word = packed_int4(e.a)
        if word is not None:
            return word, e.b, scale
    return None


def segment_sums(affine: tuple[E.Load, E.Expr, E.Expr | None]) -> bool:
    """Whether a matrix tile of these codes sums each group's dots apart before applying its scale or
    zero point (a second accumulator tile), rather than accumulating in place (per-channel scales and
    the symmetric zero point 8)."""
    _, zero, scale = affine
    return scale is not None or zero != E.Const(8)
