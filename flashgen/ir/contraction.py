"""Analyses of a contraction workload's IR that both its schedule space and its code generators read:
the Contract's extents, the operand dtype, int4 code forms, TMA-copyable operands and outputs."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Mapping

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir import prologue
from flashgen.ir.op import Contract, Store, eval_int
from flashgen.quant import INT4_PERIOD, LANE_BLOCK

if TYPE_CHECKING:
    from flashgen.workload import Workload

FLOAT16 = ("bf16", "fp16")
# Operands int4 codes enter as floats: the 16-bit ones, and e4m3 (codes less 8 are exact in it), whose
# codes are unpacked in fp16 and converted (targets/triton/contraction/ptx.py UNPACK_FLOAT).
CODE_FLOATS = (*FLOAT16, "fp8e4m3")
MMA_MIN_ROWS = 16  # the fewest rows a matrix instruction takes: fewer rows are summed on the ALUs
WARPGROUP = 4  # warps of a Hopper warpgroup, which issues one warpgroup MMA together
WARPGROUP_ROWS = 16  # rows of a warpgroup MMA's tile per warp


@functools.lru_cache(maxsize=256)
def extents(wl: Workload) -> tuple[int, int, int, Contract]:
    """M, N, K and the Contract of a contraction workload."""
    [con] = [s for s in wl.op.body(wl.attr) if isinstance(s, Contract)]
    m, n = (eval_int(e, wl.dim) for e in wl.op.domain)
    return m, n, eval_int(con.extent, wl.dim), con


def contract_int4_affine(con: Contract, attrs: Mapping[str, str], dims: Mapping[str, int]) -> tuple | None:
    """A Contract's B prologue as (packed words, zero, scale) when it is affine int4 codes
    (`prologue.affine_codes`) entering a float operand (`CODE_FLOATS`): the tiles' forms for them put
    codes under a float's exponent and scale each group's sum. Integer operands (gemm_w4a8) unpack
    codes in integers."""
    if con.operand_dtype(attrs) not in CODE_FLOATS:
        return None
    return prologue.affine_codes(con.b, dims)


@functools.lru_cache(maxsize=256)
def int4_affine(wl: Workload) -> tuple | None:
    """`contract_int4_affine` of a contraction workload's one Contract."""
    return contract_int4_affine(extents(wl)[3], wl.attr, wl.dim)


@functools.lru_cache(maxsize=256)
def whole_block_groups(wl: Workload) -> bool:
    """Whether the int4 codes' zero point and scale are constant over each block of INT4_PERIOD k (a
    word's eight codes share them: groups of 128 k or more, or per channel)."""
    affine = int4_affine(wl)
    if affine is None:
        return False
    periods = [prologue.k_period(e, wl.dim) for e in affine[1:] if e is not None]
    return all(p is None or p % INT4_PERIOD == 0 for p in periods)


def symmetric_block_groups(wl: Workload) -> bool:
    """int4 codes with the symmetric zero point and a scale constant over each block of INT4_PERIOD k,
    entering a 16-bit operand: what `operand_scale` needs to multiply the codes by their scale before
    the matrix instruction (in e4m3 the product would round to 4 significant bits)."""
    affine = int4_affine(wl)
    return bool(affine) and operand_dtype(wl) in FLOAT16 and affine[1] == E.Const(8) and affine[2] is not None and whole_block_groups(wl)


@functools.lru_cache(maxsize=256)
def tma_operands(wl: Workload) -> tuple[str, str] | None:
    """The A and B tensors when both operands are plain loads of the operand dtype at (r, k) and (c, k)
    with rows a multiple of 16 elements apart: tiles that a TMA descriptor copies to shared memory
    (zero-filled past the tensor's edges), with no prologue to apply on the way."""
    _, _, k, con = extents(wl)
    operand = operand_dtype(wl)
    a, b = con.a, con.b
    plain = (isinstance(a, E.Load) and isinstance(b, E.Load) and a.mask is None and b.mask is None
             and a.indices == (E.Index("r"), E.Index("k")) and b.indices == (E.Index("c"), E.Index("k"))
             and wl.tensor_dtype(a.tensor) == operand == wl.tensor_dtype(b.tensor))
    return (a.tensor, b.tensor) if plain and k % 16 == 0 else None


@functools.lru_cache(maxsize=256)
def gluon_int4_operands(wl: Workload) -> tuple[str, E.Load] | None:
    """The activation tensor and the packed-word Load when the weight is symmetric int4 codes
    (zero point 8) whose scale, if any, is constant over each block of INT4_PERIOD k, and the
    activations a plain 16-bit load a TMA descriptor copies (rows 16 bytes apart, K whole blocks):
    the operands of the Gluon int4 tiles (targets/gluon/int4.py), which copy packed words to shared
    memory and unpack them into the matrix instruction's register operand."""
    _, _, k, con = extents(wl)
    affine = int4_affine(wl)
    a = con.a
    plain_a = (isinstance(a, E.Load) and a.mask is None and a.indices == (E.Index("r"), E.Index("k"))
               and wl.tensor_dtype(a.tensor) == operand_dtype(wl))
    if not (affine and plain_a and operand_dtype(wl) in FLOAT16 and affine[1] == E.Const(8) and whole_block_groups(wl) and k % INT4_PERIOD == 0):
        return None
    return a.tensor, affine[0]


@functools.lru_cache(maxsize=256)
def int8_lanes(wl: Workload) -> tuple[E.Load, E.Load | None] | None:
    """The packed-word Load and the group-scale Load (None per channel) when the weight is signed int4
    codes of the `lanes` layout (`prologue.int4_lane`), optionally times a [c, k // G] scale with G a
    multiple of LANE_BLOCK, entering an int8 operand: what the `lanes` matrix tiles read with one AND
    per four codes (targets/triton/contraction/int8_lanes.py)."""
    if operand_dtype(wl) != "int8":
        return None
    b, scale = extents(wl)[3].b, None
    if isinstance(b, E.Binary) and b.op == "mul" and isinstance(b.b, E.Load):
        b, scale = b.a, b.b
        g = prologue.group_size(scale, wl.dim)
        if g is None or g % LANE_BLOCK:
            return None
    word = prologue.lane_words(b)
    return (word, scale) if word is not None else None


@functools.lru_cache(maxsize=256)
def gluon_lane_operands(wl: Workload) -> tuple[str, E.Load, E.Load | None] | None:
    """The activation tensor, the packed-word Load and the group-scale Load (None per channel) when the
    weight is `lanes` codes (`int8_lanes`) and the activations a plain int8 load a TMA descriptor copies
    (rows 16 bytes apart): the operands of the Gluon lanes tiles (targets/gluon/lanes.py), which copy
    the words' bytes to shared memory and unpack them into the int8 MMA's register operand."""
    lanes = int8_lanes(wl)
    _, _, k, con = extents(wl)
    a = con.a
    plain_a = (isinstance(a, E.Load) and a.mask is None and a.indices == (E.Index("r"), E.Index("k"))
               and wl.tensor_dtype(a.tensor) == "int8")
    if lanes is None or not plain_a or k % 16:
        return None
    return a.tensor, lanes[0], lanes[1]


@functools.lru_cache(maxsize=1024)
def lane_segment(wl: Workload, block_k: int) -> int | None:
    """The k a `lanes` tile sums apart before a group's scale: its whole k step per channel, else the
    group or the k step, whichever is shallower, where the deeper is a multiple of it (None: neither,
    or a k step not whole blocks of LANE_BLOCK k, or a workload without `lanes` codes)."""
    lanes = int8_lanes(wl)
    if lanes is None or block_k % LANE_BLOCK:
        return None
    if lanes[1] is None:
        return block_k
    g = prologue.group_size(lanes[1], wl.dim)
    return min(g, block_k) if g % block_k == 0 or block_k % g == 0 else None


def tma_output(wl: Workload) -> str | None:
    """The output a TMA copy can write a whole tile of: the epilogue's one Store, of every (r, c) of a
    2-D tensor, unmasked, overwriting, whose rows lie a multiple of 16 bytes apart (TMA clips the tile
    at the tensor's edges); None where there is no such store."""
    stores = [st for st in wl.op.body(wl.attr) if isinstance(st, Store)]
    if len(stores) != 1:
        return None
    [st] = stores
    if st.mask is not None or st.combine or st.indices != (E.Index("r"), E.Index("c")):
        return None
    n = eval_int(wl.op.tensors[st.tensor].shape[1], wl.dim)
    return st.tensor if n * dtypes.BYTES[wl.tensor_dtype(st.tensor)] % 16 == 0 else None


def operand_dtype(wl: Workload) -> str:
    """The dtype both operands enter the matrix instruction in (an attr's value where it names one)."""
    _, _, _, con = extents(wl)
    return con.operand_dtype(wl.attr)
