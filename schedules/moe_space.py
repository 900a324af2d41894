"""Schedule-space rules of the moe class (grouped GEMMs over the routed pairs), and its analytic default.

Knobs: block_m pairs of one expert per tile (an expert receives at most M pairs, one per token, so
tiles stop at the next power of two of M), block_n output columns (narrow tiles give decode, where few
experts are touched, enough programs to stream their weights), block_k depth per k step, num_warps,
num_stages (copy-pipeline buffers; AMD's pipeliner takes one or two). Tiles of 16 pairs or more run
matrix instructions (16 is the fewest rows one takes); up to DECODE_MAX_M tokens the space also holds
ALU tiles of 1-8 pairs (targets/triton/moe.py `_alu_k_loop`, the contraction class's GEMV regime),
which alone take k steps deeper than 256. Rules: the pipelined A and weight tiles (one weight tile per
Contract: gate and up are two) of a matrix tile fit the shared memory, and the accumulators (an ALU
tile's partial sums, block_m x block_k x block_n per Contract) fit the registers of the program's
threads; int4 codes entering a 16-bit float operand (w4a16g128), summed times x per group before the
group's scale as the dense int4 GEMMs do, take k steps of whole blocks of 128 in ALU tiles and within
one group in matrix tiles.
"""
from __future__ import annotations

import math

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir import prologue
from flashgen.ir.contraction import MMA_MIN_ROWS, contract_int4_affine  # (MMA_MIN_ROWS: fewer pairs sum on the ALUs)
from flashgen.ir.op import Contract
from flashgen.quant import INT4_PERIOD
from flashgen.targets.descriptor import Target
from flashgen.workload import Schedule, Workload

MAX_ACC_PER_THREAD = 128  # fp32 accumulator registers per thread
DECODE_MAX_M = 64  # up to this many tokens, the default serves decode: 16-pair tiles, narrow columns
ALU_ROWS = (1, 2, 4, 8)
MAX_MMA_BLOCK_K = 256
ALU_DEFAULT_MAX_ROWS = 4  # as the contraction class's int4 GEMV default (GEMV_INT4_DEFAULT_M): more take matrix tiles


def _p2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def touched_experts(m: int, experts: int, topk: int) -> float:
    """Experts a random top-k of m tokens chooses, on average."""
    return experts * (1.0 - (1.0 - topk / experts) ** m)


def contracts(wl: Workload) -> int:
    """Weight tiles per k step: one per Contract of the body."""
    return sum(isinstance(st, Contract) for st in wl.op.body(wl.attr))


def knobs(wl: Workload, target: Target) -> dict[str, tuple[int, ...]]:
    d = wl.dim
    n = d["N"]
    alu = tuple(b for b in ALU_ROWS if d["M"] <= DECODE_MAX_M and b <= _p2(d["M"]))
    return {"block_m": alu + tuple(b for b in (16, 32, 64, 128) if b <= max(16, _p2(d["M"]))),
            "block_n": tuple(b for b in (16, 32, 64, 128, 256) if b <= max(16, _p2(n))),
            "block_k": tuple(b for b in (32, 64, 128, 256, *((512, 1024) if alu else ()))
                             if b <= max(32, _p2(d["K"]))),
            "num_warps": (4, 8),
            "num_stages": (1, 2) if target.vendor == "amd" else (2, 3, 4, 5)}


def added_knobs(wl: Workload) -> dict[str, int]:
    return {}


def int4_group(wl: Workload) -> int | None:
    """The k over which the zero point and scale of int4 codes entering a 16-bit float operand hold
    (w4a16g128's group), whose tiles sum codes times x per group before its scale, as the dense int4
    GEMMs do; None for other formats."""
    affine = [contract_int4_affine(st, wl.attr, wl.dim) for st in wl.op.body(wl.attr) if isinstance(st, Contract)]
    if not all(affine):
        return None
    periods = [p for a in affine for p in (prologue.k_period(e, wl.dim) for e in a[1:] if e is not None) if p]
    return math.gcd(*periods) if periods else None


def why_invalid(wl: Workload, target: Target, s: Schedule) -> str | None:
    tiles = contracts(wl)
    threads = s["num_warps"] * target.warp_size
    group = int4_group(wl)
    if s["block_m"] < MMA_MIN_ROWS:  # plain loads straight into registers: no shared memory
        if group and s["block_k"] % INT4_PERIOD:
            return f"ALU tiles of int4 codes take k steps of whole blocks of {INT4_PERIOD} (the dense GEMV's terms)"
        if tiles * s["block_m"] * s["block_k"] * s["block_n"] > threads * MAX_ACC_PER_THREAD:
            return "the partial sums of the ALU tile do not fit the warps' registers"
        return None
    if s["block_k"] > MAX_MMA_BLOCK_K:
        return f"k steps deeper than {MAX_MMA_BLOCK_K} are for ALU tiles of fewer than {MMA_MIN_ROWS} pairs"
    if group and group % s["block_k"]:
        return f"matrix tiles of int4 codes take k steps within one group of {group} (one scale per dot)"
    elem = dtypes.BYTES[next(st for st in wl.op.body(wl.attr) if isinstance(st, Contract)).operand_dtype(wl.attr)]
    smem = s["num_stages"] * (s["block_m"] + tiles * s["block_n"]) * s["block_k"] * elem
    if smem > int(target.get("smem_per_block", 0)):
        return f"{smem} bytes of pipelined tiles exceed the shared memory"
    if tiles * s["block_m"] * s["block_n"] > threads * MAX_ACC_PER_THREAD:
        return "the accumulators do not fit the warps' registers"
    return None


def decode_block_n(wl: Workload, target: Target, widths: tuple[int, ...]) -> int:
    """Decode's column tile: the widest of 64, 32, 16 that still gives the touched experts' column
    tiles two programs per SM (few tokens touch few experts: their weights must stream through
    enough programs to fill the machine), else the narrowest."""
    d = wl.dim
    touched = touched_experts(d["M"], d["E"], d["KT"])
    for bn in (64, 32, 16):
        if bn in widths and touched * -(-d["N"] // bn) >= 2 * max(target.sm_count, 1):
            return bn
    return min(widths)


def pairs_per_expert(wl: Workload) -> float:
    """Pairs a touched expert serves, on average, for a random top-k."""
    d = wl.dim
    return d["M"] * d["KT"] / touched_experts(d["M"], d["E"], d["KT"])


def _alu_default(wl: Workload, target: Target, space: dict[str, tuple[int, ...]]) -> Schedule | None:
    """Quantized experts at a few pairs per expert: an ALU tile of the next power of two of the mean
    pairs per touched expert (up to ALU_DEFAULT_MAX_ROWS), 16 columns and the deepest k step whose partial sums fit 4 warps, as
    the contraction class's int4 GEMV default (deep steps keep kilobytes of weights in flight per SM).
    A 16-row matrix tile would dequantize each weight tile into the instruction's operand layout for
    one or two rows of work; 16-bit experts keep their matrix tile (0.93 of the roofline at M = 1 on
    the H200, benchmarks/results/moe.md). None where the default is a matrix tile."""
    rows = _p2(math.ceil(pairs_per_expert(wl) - 1e-9))
    if wl.attr["weights"] == "half" or rows > ALU_DEFAULT_MAX_ROWS or rows not in space["block_m"]:
        return None
    for bk in sorted(space["block_k"], reverse=True):
        s = {"block_m": rows, "block_n": min(space["block_n"]), "block_k": bk, "num_warps": 4,
             "num_stages": min(3, max(space["num_stages"]))}
        if why_invalid(wl, target, s) is None:
            return s
    return None


def whole_words_k(wl: Workload) -> int:
    """The shallowest k step the default takes: whole blocks of INT4_PERIOD k for packed int4 codes,
    which the tiles then unpack from one [block_k / 8, block_n] words tile (shallower steps, which the
    space still holds, read a word per code), else 32."""
    packed = any(prologue.packed_int4(n) for st in wl.op.body(wl.attr) if isinstance(st, Contract) for n in E.walk(st.b))
    return INT4_PERIOD if packed else 32


def default(wl: Workload, target: Target) -> Schedule:
    """Decode: ALU tiles for quantized experts at up to 4 pairs per expert (`_alu_default`), else
    16-pair tiles and columns narrow enough to fill the machine (`decode_block_n`), each k step 16 KB
    of weights or more; more tokens: 64 x 128 tiles (64 x 64 for two Contracts, which hold two
    accumulators), k steps of 64 (of whole int4 blocks, `whole_words_k`; one group, `int4_group`)."""
    space = knobs(wl, target)
    decode = wl.dim["M"] <= DECODE_MAX_M
    alu = _alu_default(wl, target, space) if decode else None
    if alu is not None:
        return alu
    block_n = decode_block_n(wl, target, space["block_n"]) if decode else 64 if contracts(wl) > 1 else 128
    block_k = min(max((128 if block_n >= 64 else 256) if decode else 64, whole_words_k(wl)),
                  int4_group(wl) or MAX_MMA_BLOCK_K)
    mma_k = tuple(b for b in space["block_k"] if b <= MAX_MMA_BLOCK_K)
    for stages in (3, 2, 1):
        s = {"block_m": 16 if decode else min(64, max(space["block_m"])),
             "block_n": min(block_n, max(space["block_n"])), "block_k": min(block_k, max(mma_k)),
             "num_warps": 4, "num_stages": stages}
        if stages in space["num_stages"] and why_invalid(wl, target, s) is None:
            return s
    return {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": min(space["num_stages"])}
