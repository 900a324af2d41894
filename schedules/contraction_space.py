"""The contraction class's schedule space: tiled tensor-core GEMM, which at small M becomes a GEMV.

A schedule names its `variant`, the generator's form (flashgen/ir/variants.py), and holds the knobs that
form reads (`variants`): block_m x block_n output tile, block_k depth per k step, num_warps, num_stages
(software pipelining buffers), group_m (row tiles launched together so they share weight tiles in the
L2; a knob only where the form's tiles leave more than one row of tiles), split_k (programs sharing one
tile's k range when the tiles alone leave SMs idle; the last of them to finish adds the fp32/int32
partial tiles in a fixed order and runs the epilogue), persistent (0: one program per tile; n: n
programs per SM, each walking tiles in order, so the last wave's tiles start while earlier tiles'
epilogues finish), dequant_chunks (a weight dequantized first: its rows in 2, 4 or 8 chunks, each
chunk's dequant overlapping the previous chunk's GEMM; Triton tiles only).
The variants stand for the options records once held as knobs of their own (`flat_of` spells them out;
the rules and the cost model's features read that form, and `current` reads such a record as its
variant): GEMV tiles of 1-8 rows (gemv*) or matrix tiles (tile*, gluon*); tma (tile_tma: sm_90,
operands without a prologue, A and W tiles copied by TMA descriptors instead of per-thread loads);
ptx_unpack (NVIDIA int4 tiles: two codes per 32-bit AND-OR in inline PTX, gemv_ptx and tile_ptx; in GEMV
tiles products in fp16 pairs, summed per word or per quad of consecutive words, gemv_ptx_quad);
operand_scale (tile_ptx_scaled: symmetric codes in groups of 128 k or more, each code pair multiplied
by its group scale in the 16-bit float, so that all groups accumulate in one tile); early_load (*_early:
GEMV tiles on targets with programmatic dependent launch, the first k step's weights loaded before
waiting for the previous kernel); backend (gluon*: the Gluon generator, targets/gluon: NVIDIA sm_90,
operands TMA copies, a ring of num_stages mbarrier-guarded slots, asynchronous warpgroup MMA);
producer_warps (gluon_warp: a warp of its own issues the copies while the num_warps warps only issue
MMAs and the epilogues, persistent or not; plain gluon: the same warps do both, one tile per program);
consumers (gluon_pingpong: persistent, a producer warp, two warpgroups of num_warps = 4 warps take
turns at the program's tiles, so that one's epilogue runs while the other's MMAs do); tma_store
(gluon*_store: an output a TMA can write, each tile's result goes to shared memory and a TMA copy
writes it while the next tile computes); gluon_int4 (symmetric int4 codes copied as words); gluon_lanes
(gemm_w4a8's `lanes` codes copied as bytes, unpacked with their group scale into int8 warpgroup MMAs'
register operands while the previous MMAs run, targets/gluon/lanes.py); lanes
(tile_lanes: gemm_w4a8's `lanes` layout, four int8 lanes per AND in the matrix instruction's k order,
int8 matrix tiles computed transposed, a group's int32 sum times its integer scale; every target;
operand_scale on lanes, tile_lanes_scaled: each group's integer scale multiplied into its lanes before the
instruction, two integer instructions per four codes, so that every group sums into one int32 tile);
dequant_first (dq_*: ops with a weight prologue, at DEQUANT_FIRST_MIN_M rows or more, the weight
dequantized by a pointwise kernel of its own and a dense form's tiles, with the dense op's knobs and
rules, run on it; targets/staged.py).
Rules: the pipelined tiles must fit the target's shared memory (LDS on AMD), the accumulator must fit
the registers of the program's threads, tiles stop at the next power of two of each extent (16 is
the smallest tile a matrix instruction takes), each split of a pipelined tile gets at least
SPLIT_K_MIN_STEPS k steps (a one-stage GEMV tile, whose best form is one deep step, at least one),
persistent programs do not split K, one stage (no copy pipeline) serves NVIDIA GEMV tiles only,
early loads serve unsplit GEMV tiles, lanes tiles are matrix tiles whose k steps hold whole groups or
a part of one, PTX-unpacked GEMV tiles need
groups of 128 k or more, k tiles deeper than 512 are for ALU tiles only, and k tiles of packed int4
words are whole blocks of 128 k. At M <= 16 the space holds the GEMV regime:
one 16-row tile, narrow block_n for many programs, deep block_k for long contiguous loads; and tiles
of 1-8 rows, whose products are summed on the ALUs (targets/triton/contraction.py), bounded by the
products each thread holds per k step.
Regimes (`why_other_regime`): a schedule tuned at one row count serves another only in its own regime,
so that dispatch's buckets never cross one: a GEMV tile where it covers every row of the call (a
one-row tile over 16 rows reads the whole weight 16 times), a weight dequantized first from
DEQUANT_FIRST_MIN_M rows, matrix tiles wherever the space allows them. Dispatch's buckets also leave
out, where the default's row tile covers every row of the call and its programs fill the SMs, a tile
that does not cover them (`why_not_bucket`: a 16-row tile at 64 rows reads the weight 4 times where
the default's reads it once).
"""
from __future__ import annotations

import functools
from typing import Any

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir import prologue
from flashgen.ir.contraction import (MMA_MIN_ROWS, WARPGROUP, WARPGROUP_ROWS, extents, gluon_int4_operands,
                                     gluon_lane_operands, int4_affine, int8_lanes, lane_segment, operand_dtype, symmetric_block_groups, tma_operands, tma_output,
                                     whole_block_groups)
from flashgen.ir.op import Let
from flashgen.ir.variants import COUNT_DEFAULTS, DEQUANT, OPTIONS, VARIANTS, flat, from_flat, reads
from flashgen.quant import INT4_PERIOD, LANE_BLOCK
from flashgen.targets.descriptor import Target
from flashgen.workload import Workload, dequant_forms

MAX_ACC_PER_THREAD = 128  # fp32 accumulator registers per thread
MAX_MMA_BLOCK_K = 512  # deeper k tiles only serve ALU tiles: a program needs many bytes in flight
MAX_PRODUCTS_PER_THREAD = 512  # such a tile's products per thread per k step, at most (registers)
MIN_PRODUCTS_PER_THREAD = 32  # and at least, or threads idle and loads narrow
GEMV_INT4_DEFAULT_M = 4  # int4 GEMV tiles cost ~4 instructions per code and row: the default up to 4 rows
SPLIT_K_MIN_STEPS = 2  # k steps per split of a pipelined tile, at least: fewer leaves its pipeline empty
# Knobs added after records existed, and the value a record without them was measured with.
ADDED_KNOBS = {"split_k": 1, "persistent": 0, "tma": 0, "ptx_unpack": 0, "early_load": 0, "operand_scale": 0,
               "dequant_first": 0, "dequant_chunks": 1, "backend": 0, "producer_warps": 0, "tma_store": 0,
               "consumers": 1, "lanes": 0}
# Every knob of a schedule spelled out flat (`flat_of`), as records were written before variants.
FLAT_KNOBS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m", "split_k", "persistent", "tma",
              "ptx_unpack", "early_load", "operand_scale", "dequant_first", "dequant_chunks", "backend",
              "producer_warps", "tma_store", "consumers", "lanes")
MAX_TMA_BOX = 256  # elements per dimension of a TMA copy
GEMV_MAX_M = 16  # up to this M, tiles of 1-8 rows (summed on the ALUs, no matrix instruction) are in the space
# From this M, a weight may be dequantized first (`dequant_first`): its round trip through memory (a
# 16-bit weight written and read back, besides the codes) moves 4 bytes per weight more than a fused
# tile, about 40 us for 8192² at the H200's copy bandwidth: some 5% of the GEMM's time at M = 4096,
# half of it at M = 512, and more than all of a fused GEMM at M <= 256, where it is not offered.
DEQUANT_FIRST_MIN_M = 512
CHUNK_MIN_WAVES = 1.9  # tiles per SM that each chunk of a weight dequantized first keeps, by default
DEQUANT_FIRST_DEFAULT_M = 2048  # and the default from here (measured: 5% of the staged 8192² GEMM at M = 4096)
GLUON_ARCH = 90  # warpgroup MMA is sm_90's (sm_90a): the Gluon tiles build for it alone
SWIZZLE_BYTES = 128  # a TMA copy into swizzled shared memory takes rows of at most this many bytes
# Shared memory Triton 3.6 takes to turn a Gluon int4 tile's fp32 accumulator into the epilogue's layout:
# the whole tile, up to 64 KiB (measured on AOT builds: 4 KiB for 16 x 64, 64 KiB for 128 x 128 and 256 x 128).
GLUON_EPILOGUE_SCRATCH = 65536
GLUON_INT8_MAX_N = 128  # Triton 3.6 lowers int8 warpgroup MMAs of at most 128 columns (256 fails to build)
# Registers a thread of a Gluon lanes tile gives the int32 accumulator and a k step's unpacked operands
# (held until the step's MMAs are done), of its 255: the rest holds addresses, scales and the unpacking.
GLUON_LANES_MAX_REGS = 160
GLUON_LANES_DEFAULT_M = 256  # from this M, `lanes` codes default to the Gluon lanes tile on sm_90 (`_gluon_lanes_default`)


def _p2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _flat_knobs(wl: Workload, target: Target) -> dict[str, tuple[int, ...]]:
    """Each size's values, and each option's (0: off) where the workload and target offer it, as one
    flat list (a weight dequantized first takes its dense form's, `variants`)."""
    m, n, k, _ = extents(wl)
    amd = target.vendor == "amd"
    gemv_rows = tuple(b for b in (1, 2, 4, 8) if m <= GEMV_MAX_M and b <= _p2(m))
    kn = {"block_m": gemv_rows + tuple(b for b in (16, 32, 64, 128, 256) if b <= max(16, _p2(m))),
          "block_n": tuple(b for b in (16, 32, 64, 128, 256) if b <= max(16, _p2(n))),
          "block_k": tuple(b for b in (32, 64, 128, 256, 512, 1024, 2048)
                           if b % min_block_k(wl) == 0 and b <= max(min_block_k(wl), _p2(k))),
          "num_warps": (2, 4, 8),
          "num_stages": (1, 2) if amd else (1, 2, 3, 4, 5) if gemv_rows else (2, 3, 4, 5),
          "group_m": (1, 8),
          "split_k": (1, 2, 4, 8),
          "persistent": (0, 1, 2),
          "tma": (0, 1) if tma_operands(wl) and target.capability >= 90 else (0,),
          "ptx_unpack": ((0, 1, 2) if gemv_rows and whole_block_groups(wl) else (0, 1))
                        if target.vendor == "nvidia" and int4_affine(wl) else (0,),
          "early_load": (0, 1) if gemv_rows and target.pdl else (0,),
          "operand_scale": (0, 1) if (target.vendor == "nvidia" and symmetric_block_groups(wl)) or lane_group_scales(wl)
                           else (0,),
          "backend": (0, 1) if gluon_target(target) and gluon_operands(wl) else (0,),
          "producer_warps": (0, 1) if gluon_target(target) and gluon_operands(wl) else (0,),
          "tma_store": (0, 1) if gluon_target(target) and tma_operands(wl) and tma_output(wl) else (0,),
          "consumers": (1, 2) if gluon_target(target) and tma_operands(wl) else (1,),
          "lanes": (0, 1) if int8_lanes(wl) else (0,),
          "dequant_first": (0,), "dequant_chunks": (1,)}
    return kn


def gluon_target(target: Target) -> bool:
    """Whether the Gluon generator builds for `target` (NVIDIA sm_90)."""
    return target.vendor == "nvidia" and target.capability == GLUON_ARCH


def gluon_operands(wl: Workload) -> bool:
    """Whether a Gluon tile takes the workload's operands: plain TMA copies, symmetric int4 codes, or
    `lanes` codes with int8 activations."""
    return bool(tma_operands(wl) or gluon_int4_operands(wl) or gluon_lane_operands(wl))


def gluon_invalid(wl: Workload, target: Target, s: dict[str, Any]) -> str | None:
    """The Gluon tile's own rules (targets/gluon/contraction.py), or None."""
    if not gluon_target(target) or not gluon_operands(wl):
        return ("Gluon tiles build for NVIDIA sm_90, on operands TMA copies (no prologue), symmetric int4 codes "
                f"in whole blocks of {INT4_PERIOD} k, or lanes codes")
    if gluon_lane_operands(wl):
        return _gluon_lanes_invalid(wl, target, s)
    if not tma_operands(wl):
        return _gluon_int4_invalid(wl, target, s)
    if s["split_k"] > 1 or s["tma"] or s["ptx_unpack"] or s["early_load"] or s["operand_scale"]:
        return "Gluon tiles are unsplit, with their own TMA copies"
    if s["persistent"] and not s["producer_warps"]:
        return "persistent Gluon programs walk their tiles with a producer warp"
    if s["consumers"] > 1 and not (s["producer_warps"] and s["persistent"] and s["num_warps"] == WARPGROUP):
        return (f"{s['consumers']} consumers take turns at a persistent program's tiles, fed by a producer warp, "
                f"one warpgroup ({WARPGROUP} warps) each")
    if s["num_warps"] % WARPGROUP or s["block_m"] % (WARPGROUP_ROWS * s["num_warps"]):
        return (f"a Gluon tile is whole warpgroups ({WARPGROUP} warps) of {WARPGROUP_ROWS} rows per warp: "
                f"block_m={s['block_m']} with {s['num_warps']} warps")
    if s["block_k"] * operand_bytes(wl) > SWIZZLE_BYTES:
        return f"a Gluon k step copies rows of at most {SWIZZLE_BYTES} bytes"
    if operand_dtype(wl) == "int8" and s["block_n"] > GLUON_INT8_MAX_N:
        return f"Gluon int8 tiles are at most {GLUON_INT8_MAX_N} columns wide"
    return None


def _gluon_int4_invalid(wl: Workload, target: Target, s: dict[str, Any]) -> str | None:
    """The Gluon int4 tile's rules (targets/gluon/int4.py): acc^T, weight rows on the MMA's 64-row
    side, a producer warp, one block of packed words per k step, code pairs unpacked in PTX."""
    if s["persistent"] or s["tma"] or s["early_load"] or s["consumers"] > 1 or s["tma_store"]:
        return "Gluon int4 tiles are one program per tile (or per split of K), one consumer, with their own TMA copies"
    if not s["producer_warps"]:
        return "Gluon int4 tiles are fed by a producer warp"
    if s["ptx_unpack"] != 1:
        return "Gluon int4 tiles unpack code pairs in PTX (ptx_unpack 1)"
    if s["operand_scale"] != int(int4_affine(wl)[2] is not None):
        return "Gluon int4 tiles multiply group scales into the codes (operand_scale 1), per-channel ones into the sum (0)"
    if s["block_k"] != INT4_PERIOD:
        return f"a Gluon int4 k step is one block of {INT4_PERIOD} k"
    if s["block_m"] < MMA_MIN_ROWS:
        return f"a Gluon int4 tile takes at least {MMA_MIN_ROWS} activation rows (the MMA's narrow side)"
    if s["num_warps"] % WARPGROUP or s["block_n"] % (WARPGROUP_ROWS * s["num_warps"]):
        return (f"a Gluon int4 tile's weight rows are whole warpgroups ({WARPGROUP} warps) of {WARPGROUP_ROWS} rows "
                f"per warp: block_n={s['block_n']} with {s['num_warps']} warps")
    ring = s["num_stages"] * (s["block_m"] * operand_bytes(wl) + s["block_n"] // 2) * s["block_k"]
    turn = min(s["block_m"] * s["block_n"] * 4, GLUON_EPILOGUE_SCRATCH)  # the accumulator turned for the epilogue
    limit = int(target.get("smem_per_block", 0))
    if ring + turn > limit:
        return f"{ring} bytes of ring slots and {turn} of epilogue scratch exceed the {limit} bytes of shared memory"
    return None


def _gluon_lanes_invalid(wl: Workload, target: Target, s: dict[str, Any]) -> str | None:
    """The Gluon lanes tile's rules (targets/gluon/lanes.py): acc^T, weight rows on the MMA's 64-row
    side, a producer warp, k steps of whole 64-k byte tiles, the accumulator and a step's unpacked
    operands in registers."""
    if not s["lanes"]:
        return "Gluon tiles read lanes codes as lanes (lanes 1)"
    if s["persistent"] or s["tma"] or s["early_load"] or s["consumers"] > 1 or s["tma_store"]:
        return "Gluon lanes tiles are one program per tile (or per split of K), one consumer, with their own TMA copies"
    if not s["producer_warps"]:
        return "Gluon lanes tiles are fed by a producer warp"
    if s["block_k"] % (2 * LANE_BLOCK) or s["block_k"] // 2 > SWIZZLE_BYTES:
        return (f"a Gluon lanes k step is whole byte tiles of {2 * LANE_BLOCK} k, its rows at most {SWIZZLE_BYTES} "
                f"bytes (block_k={s['block_k']})")
    if not MMA_MIN_ROWS <= s["block_m"] <= GLUON_INT8_MAX_N:
        return (f"a Gluon lanes tile takes {MMA_MIN_ROWS} to {GLUON_INT8_MAX_N} activation rows (the int8 MMA's "
                "narrow side)")
    if s["num_warps"] % WARPGROUP or s["block_n"] % (WARPGROUP_ROWS * s["num_warps"]):
        return (f"a Gluon lanes tile's weight rows are whole warpgroups ({WARPGROUP} warps) of {WARPGROUP_ROWS} rows "
                f"per warp: block_n={s['block_n']} with {s['num_warps']} warps")
    threads = s["num_warps"] * target.warp_size
    regs = (s["block_m"] * s["block_n"] + s["block_n"] * s["block_k"] // 4) // threads
    if regs > GLUON_LANES_MAX_REGS:
        return (f"a {s['block_n']}x{s['block_m']} int32 accumulator and a k step's unpacked operands take {regs} "
                f"registers a thread, more than {GLUON_LANES_MAX_REGS}")
    ring = s["num_stages"] * (s["block_m"] + s["block_n"] // 2) * s["block_k"]
    turn = min(s["block_m"] * s["block_n"] * 4, GLUON_EPILOGUE_SCRATCH)
    limit = int(target.get("smem_per_block", 0))
    if ring + turn > limit:
        return f"{ring} bytes of ring slots and {turn} of epilogue scratch exceed the {limit} bytes of shared memory"
    return None


@functools.lru_cache(maxsize=256)
def dequant_first_form(wl: Workload) -> Workload | None:
    """The dense workload a weight dequantized first runs, where the space offers it, else None."""
    forms = dequant_forms(wl)
    return forms[1] if forms and extents(wl)[0] >= DEQUANT_FIRST_MIN_M else None


def operand_bytes(wl: Workload) -> int:
    return dtypes.BYTES[operand_dtype(wl)]


@functools.lru_cache(maxsize=1024)
def load_bytes(wl: Workload, block_k: int) -> tuple[float, float]:
    """Bytes loaded per element of the A and B tiles, after the prologue is made tile-shaped
    (flashgen/ir/prologue.py): a packed int4 word serves eight elements, a group's scale G elements,
    a per-tile scale row none to speak of. The software pipeliner keeps each load in shared memory for every stage."""
    _, _, _, con = extents(wl)
    lets = {st.name: st.value for st in wl.op.body(wl.attr) if isinstance(st, Let)}

    def total(e: E.Expr) -> float:
        unpacked: dict = {}
        grouped: dict = {}
        e = prologue.rewrite(e, wl.dim, block_k, unpacked, grouped)
        n = sum(dtypes.BYTES[wl.tensor_dtype(w.tensor)] / 8 for w in unpacked)
        n += sum(dtypes.BYTES[wl.tensor_dtype(g.tensor)] / prologue.group_size(g, wl.dim) for g in grouped)
        seen = set()
        stack = [e]
        while stack:
            x = stack.pop()
            if isinstance(x, E.Ref) and x.name in lets:
                stack.append(lets[x.name])
                continue
            if isinstance(x, E.Load) and x not in seen:
                seen.add(x)
                per_tile = not any(isinstance(i, E.Index) and i.axis == "k" for ix in x.indices for i in E.walk(ix))
                n += 0 if per_tile else dtypes.BYTES[wl.tensor_dtype(x.tensor)]
            stack.extend(E.children(x))
        return n

    # (`lanes` codes are signed nibbles the rewrite does not unpack: half a byte each, as `lane_bytes` says)
    return total(con.a), lane_bytes(wl) if int8_lanes(wl) else total(con.b)


@functools.lru_cache(maxsize=256)
def min_block_k(wl: Workload) -> int:
    """The shallowest k step: packed int4 words interleave INT4_PERIOD k (flashgen/quant.py), and a
    k step takes whole blocks of them."""
    _, _, _, con = extents(wl)
    packed = any(prologue.packed_int4(e) for e in E.walk(con.b))
    return INT4_PERIOD if packed else 32


@functools.lru_cache(maxsize=256)
def accumulator_tiles(wl: Workload) -> int:
    """Accumulator tiles a matrix tile keeps: two when int4 groups sum apart before their scale."""
    affine = int4_affine(wl)
    return 2 if affine and prologue.segment_sums(affine) else 1


def lane_group_scales(wl: Workload) -> bool:
    """Whether the workload's `lanes` codes have integer group scales (what tile_lanes_scaled multiplies in)."""
    lanes = int8_lanes(wl)
    return lanes is not None and lanes[1] is not None


def lane_bytes(wl: Workload) -> float:
    """Bytes a `lanes` tile loads per weight element: half a byte of code, and its group's scale."""
    scale = int8_lanes(wl)[1]
    return 0.5 + (0 if scale is None else dtypes.BYTES[wl.tensor_dtype(scale.tensor)] / prologue.group_size(scale, wl.dim))


def min_stages(target: Target, s: dict[str, Any]) -> int:
    """1 on AMD and for NVIDIA GEMV tiles, whose plain loads go straight to registers (no copy
    pipeline through shared memory); NVIDIA matrix tiles keep at least 2."""
    return 1 if target.vendor == "amd" or s["block_m"] < MMA_MIN_ROWS else 2


def _flat_invalid(wl: Workload, target: Target, s: dict[str, Any]) -> str | None:
    """The rules, on a schedule spelled out flat (`flat_of`)."""
    if s["dequant_chunks"] > 1 and not s["dequant_first"]:
        return "chunks of a dequantized weight need dequant_first"
    if s["dequant_first"]:
        if s["ptx_unpack"] or s["operand_scale"] or s["lanes"]:
            return "a weight dequantized first has no codes to unpack or scale"
        n, chunks = wl.dim["N"], s["dequant_chunks"]
        if chunks > 1 and s["backend"]:
            # Measured on the H100, o at M = 4096, medians of 30 runs each: a Gluon tile's chunks beside
            # the side stream's dequants took 230-484 us from one timing to the next, in one chunk 246-279,
            # Triton's chunks 224-240. A record of such a schedule says little of its next run.
            return "Gluon tiles of a weight dequantized first run in one chunk (beside the dequant, their time varies 2x)"
        if chunks > 1 and n % (chunks * 16):  # (16 rows: every chunk's slices start on 16-byte boundaries)
            return f"N={n} does not split into {chunks} chunks of a multiple of 16 rows"
        return _flat_invalid(dequant_forms(wl, chunks)[1], target, {**s, "dequant_first": 0, "dequant_chunks": 1})
    if (s["producer_warps"] or s["tma_store"] or s["consumers"] > 1) and not s["backend"]:
        return "producer warps, consumer warpgroups and TMA stores serve Gluon tiles (backend 1)"
    if s["backend"]:
        why = gluon_invalid(wl, target, s)
        if why:
            return why
    if s["tma"] and not tma_operands(wl):
        return "TMA copies serve operands without a prologue (or a weight dequantized first)"
    if s["block_k"] % min_block_k(wl):
        return f"int4 words interleave {INT4_PERIOD} k: block_k must be a multiple of {INT4_PERIOD}"
    a_bytes, b_bytes = load_bytes(wl, s["block_k"])
    smem = s["num_stages"] * (s["block_m"] * a_bytes + s["block_n"] * b_bytes) * s["block_k"]
    if s["tma_store"]:  # the output tile, staged for its copy (one per consumer)
        smem += s["consumers"] * s["block_m"] * s["block_n"] * dtypes.BYTES[wl.tensor_dtype(tma_output(wl))]
    limit = int(target.get("smem_per_block", 0))
    if smem > limit:
        return f"{smem} bytes of pipelined tiles exceed the {limit} bytes of shared memory"
    threads = s["num_warps"] * target.warp_size
    if s["persistent"] and s["split_k"] > 1:
        return "persistent programs walk whole tiles: split_k must be 1"
    min_steps = 1 if s["num_stages"] == 1 else SPLIT_K_MIN_STEPS  # one stage: no copy pipeline to keep full
    if s["split_k"] > 1 and -(-extents(wl)[2] // s["block_k"]) < s["split_k"] * min_steps:
        return f"{s['split_k']} splits of K={extents(wl)[2]} leave fewer than {min_steps} k step{'s' * (min_steps > 1)} of {s['block_k']} each"
    if not s["lanes"] and s["block_m"] >= MMA_MIN_ROWS and int8_lanes(wl):
        # (their shared-memory rule once counted each code as its word, which kept most of them out)
        return ("`lanes` codes are read by lanes tiles: a matrix tile unpacking them in its prologue took "
                "1192-5019 us at 64 rows on an H100, the lanes tiles 11-37 us")
    if s["lanes"]:
        if not int8_lanes(wl):
            return "lanes tiles read int4 codes of gemm_w4a8's `lanes` layout"
        if s["block_m"] < MMA_MIN_ROWS:
            return f"lanes tiles are matrix tiles of at least {MMA_MIN_ROWS} rows"
        if lane_segment(wl, s["block_k"]) is None:
            return (f"a lanes k step is whole blocks of {LANE_BLOCK} k, and whole groups or a part of one "
                    f"(block_k={s['block_k']})")
    if s["ptx_unpack"] == 2 and s["block_m"] >= MMA_MIN_ROWS:
        return f"PTX quads of words serve GEMV tiles of fewer than {MMA_MIN_ROWS} rows"
    if s["operand_scale"] and (s["block_m"] < MMA_MIN_ROWS or s["ptx_unpack"] + s["lanes"] != 1
                               or (s["lanes"] and not lane_group_scales(wl))):
        return (f"operand scaling serves matrix tiles of at least {MMA_MIN_ROWS} rows: PTX-unpacked int4 codes, "
                "or lanes codes in groups")
    if s["ptx_unpack"] and s["block_m"] < MMA_MIN_ROWS and not whole_block_groups(wl):
        return f"PTX unpacking of GEMV tiles pairs codes 64 k apart: groups must span {INT4_PERIOD} k"
    if s["num_stages"] < min_stages(target, s):
        return f"NVIDIA matrix tiles are pipelined: at least {min_stages(target, s)} stages"
    if s["early_load"] and (s["block_m"] >= MMA_MIN_ROWS or s["split_k"] > 1 or s["persistent"]):
        return f"early weight loads serve GEMV tiles of fewer than {MMA_MIN_ROWS} rows, unsplit, not persistent"
    if s["tma"] and (s["block_m"] < MMA_MIN_ROWS or s["block_k"] > MAX_TMA_BOX):
        return f"TMA copies serve matrix tiles of at least {MMA_MIN_ROWS} rows, at most {MAX_TMA_BOX} deep"
    if s["block_k"] > MAX_MMA_BLOCK_K and s["block_m"] >= MMA_MIN_ROWS:
        return f"k tiles deeper than {MAX_MMA_BLOCK_K} are for GEMV tiles of fewer than {MMA_MIN_ROWS} rows"
    if s["block_m"] < MMA_MIN_ROWS:
        products = s["block_m"] * s["block_n"] * s["block_k"]
        if products > threads * MAX_PRODUCTS_PER_THREAD:
            return f"a {s['block_m']}x{s['block_k']}x{s['block_n']} product tile does not fit {threads} threads' registers"
        whole = s["block_n"] >= extents(wl)[1] and s["block_k"] >= extents(wl)[2]  # nothing left to give threads
        if products < threads * MIN_PRODUCTS_PER_THREAD and not whole:
            return f"a {s['block_m']}x{s['block_k']}x{s['block_n']} product tile leaves some of {threads} threads idle"
        return None
    tiles = 1 if s["operand_scale"] else accumulator_tiles(wl)
    if s["lanes"] and int8_lanes(wl)[1] is not None and not s["operand_scale"]:
        tiles = 2  # a group's int32 sum beside the accumulator
    if tiles * s["block_m"] * s["block_n"] > threads * MAX_ACC_PER_THREAD:
        return f"{tiles} {s['block_m']}x{s['block_n']} accumulator tile(s) do not fit {threads} threads' registers"
    if s["block_m"] * s["block_n"] < threads * 4 and s["num_warps"] > 2:
        return "too few accumulator elements for the warps"
    return None


def _gluon_lanes_default(wl: Workload, target: Target) -> dict[str, int] | None:
    """`lanes` codes at GLUON_LANES_DEFAULT_M rows or more on sm_90: the Gluon lanes tile of 128
    activation rows by 256 weight rows (8 warps, 128 k a step, 4 stages), narrowed to 128 weight rows
    where its tiles would leave SMs idle, and to 64 activation rows where 128 x 128 tiles would fill
    fewer than half the SMs. Each narrower tile reads its weight rows again for more row tiles: on the
    H100 at M = 256, qkv's 96 tiles of 128 x 128 took 20.5 us and its 192 of 64 x 128 36.0, while o's
    64 tiles of 128 x 128 left half the SMs idle (its records' best: 64 x 128). The H100's records: at
    M = 4096 the 128 x 256 tile was the best of five schedules on every Llama-3-8B shape, 1.12-1.15x
    faster than the weight dequantized first and 1.9-2.1x the Triton lanes tile; at M = 256 the Gluon
    tile was the best on o, gate_up and down, 1.04-1.33x the Triton lanes tile, and 0.95x it on qkv.
    Tiles stop at the extents' next powers of two (one warpgroup where fewer than 128 weight rows);
    None where the rules refuse even that (the Triton default then)."""
    m, n, _, _ = extents(wl)
    kn = _flat_knobs(wl, target)
    sms = max(int(target.sm_count), 1)
    bm, bn = 128, 256
    if -(-m // bm) * -(-n // bn) < sms:
        bn = 128
    if 2 * -(-m // bm) * -(-n // bn) < sms:
        bm = 64
    bm, bn = min(bm, kn["block_m"][-1]), min(bn, kn["block_n"][-1])
    for warps in (8, WARPGROUP):
        s = {**ADDED_KNOBS, "block_m": bm, "block_n": bn, "block_k": 128, "num_warps": warps, "num_stages": 4,
             "group_m": 8, "backend": 1, "producer_warps": 1, "lanes": 1, "operand_scale": int(lane_group_scales(wl))}
        if _flat_invalid(wl, target, s) is None:
            return s
    return None


def _flat_default(wl: Workload, target: Target) -> dict[str, int]:
    """Analytic choice per regime, spelled out flat, shrunk until it satisfies the rules."""
    m, n, k, con = extents(wl)
    if m >= GLUON_LANES_DEFAULT_M and gluon_target(target) and gluon_lane_operands(wl):
        gluon = _gluon_lanes_default(wl, target)
        if gluon is not None:
            return gluon
    dense = dequant_first_form(wl)
    if dense is not None and m >= DEQUANT_FIRST_DEFAULT_M:
        # Thousands of rows share each weight tile: the dense op's tile on the weight dequantized first,
        # in as many chunks as keep about two waves of tiles in each chunk's GEMM (side by side on the
        # H200's five Llama weights at M = 4096: 4 chunks of 8192² and gate_up, 2 of qkv and o, 2-5%
        # faster than one; 4 chunks of qkv and o, under 1.5 waves each, 20-40% slower).
        s = {**_flat_default(dense, target), "dequant_first": 1}
        sms = max(int(target.sm_count), 1)
        for chunks in (4, 2, 1):
            tiles = -(-m // s["block_m"]) * -(-(n // chunks) // s["block_n"])
            if chunks == 1 or tiles >= CHUNK_MIN_WAVES * sms and _flat_invalid(wl, target, {**s, "dequant_chunks": chunks}) is None:
                return {**s, "dequant_chunks": chunks}
    kn = _flat_knobs(wl, target)
    stages = kn["num_stages"][-1] if target.vendor == "amd" else 4
    sms = max(int(target.sm_count), 1)
    if m <= GEMV_INT4_DEFAULT_M and 2 in kn["ptx_unpack"]:
        # NVIDIA: quads of words in fp16 pairs, 2048-deep k steps loaded straight into registers (the
        # H200's M=1 records: within 0-12% of the best schedule on the five shapes, and 1.31-1.54x
        # faster than the pipelined fp32 tile below).
        s = {"block_m": _p2(m), "block_n": 16, "block_k": 2048, "num_warps": 4, "num_stages": 1,
             "ptx_unpack": 2, "group_m": 1, "split_k": 1, "persistent": 0}
    elif m <= GEMV_INT4_DEFAULT_M and int4_affine(wl):
        # int4 codes summed on the ALUs (no dequantized tile for a matrix instruction): 16-column tiles
        # for many programs, and deep k steps of 4 warps, so that every SM has warps to issue from and
        # kilobytes of words in flight (measured on the H200: 512-deep k steps ran 2.4-2.7x faster than 128- or
        # 256-deep ones).
        s = {"block_m": _p2(m), "block_n": 16, "block_k": 1024, "num_warps": 4,
             "num_stages": min(3, kn["num_stages"][-1]), "group_m": 1, "split_k": 1, "persistent": 0}
    elif m <= 64 and (int4_affine(wl) or int8_lanes(wl)):
        # int4 codes unpacked into the weight operand of 64-row matrix tiles (one warpgroup), 128 k per
        # step, with K split until about two programs run per SM: the unpacking is the work, two codes
        # per inline-PTX AND-OR where the target has it (the H200's M = 16 and 64 records: 1.06-1.28x
        # faster than Triton's unpacking), four int8 lanes per AND for `lanes` codes.
        tiles = -(-n // 64) * -(-m // max(16, _p2(m)))
        split = max([sp for sp in (1, 2, 4) if tiles * sp <= 2 * sms and -(-k // 128) >= sp * SPLIT_K_MIN_STEPS] or [1])
        # `lanes` codes in groups take their group's scale into the lanes (one int32 sum, no group
        # epilogue between the instructions: 296 -> 171 instructions a k step of a 128 x 128 tile on sm_90).
        s = {"block_m": max(16, _p2(m)), "block_n": 64, "block_k": 128, "num_warps": 4,
             "num_stages": min(4, kn["num_stages"][-1]), "group_m": 8, "split_k": split, "persistent": 0,
             "ptx_unpack": int(1 in kn["ptx_unpack"]), "lanes": int(1 in kn["lanes"]),
             "operand_scale": int(1 in kn["lanes"] and lane_group_scales(wl))}
    elif int8_lanes(wl):
        # Large M, `lanes` codes: int8 matrix tiles of 128 x 128, the group scales in the lanes (or,
        # per channel, the tile's sum shifted once).
        s = {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 4, "group_m": 8,
             "split_k": 1, "persistent": 0, "lanes": 1, "operand_scale": int(lane_group_scales(wl))}
    elif int4_affine(wl) and 1 in kn["operand_scale"]:
        # Large M, NVIDIA: PTX-unpacked code pairs times their group scale, one accumulator, so 256-row
        # tiles fit; 2 persistent programs per SM where such tiles fill the SMs, 128-row tiles where they
        # would not (the H200's M = 256 and 4096 records: within 0-7% of the best on the shapes they
        # fill, 1.2-1.6x faster than the two-accumulator tile below).
        wide = -(-m // 256) * -(-n // 128) >= sms
        s = {"block_m": 256 if wide else 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3,
             "group_m": 8, "split_k": 1, "persistent": 2 if wide else 0, "ptx_unpack": 1, "operand_scale": 1}
    elif int4_affine(wl):
        # Large M: int4 matrix tiles of 128 x 128 (a group's sums and the tile's in registers), 8 warps.
        s = {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3, "group_m": 8,
             "split_k": 1, "persistent": 0}
    elif m == 1 and target.vendor != "amd":
        # One row on the ALUs, 16 columns, 512-deep pipelined steps, the first before the wait where the
        # target launches dependents early (the H200's M=1 records: bf16 1.02-1.30x faster than the
        # 16-row tile below on the five shapes; W8A8 within 0-15% of its best).
        s = {"block_m": 1, "block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 3, "group_m": 1,
             "split_k": 1, "persistent": 0, "early_load": max(kn["early_load"])}
    elif m <= 16:
        # A GEMV: narrow column tiles so that at least two programs stream weights on every SM.
        bn = max([b for b in (16, 32, 64) if n // b >= 2 * sms] or [16])
        warps = 4 if 16 * bn >= 4 * target.warp_size * 4 else 2  # see why_invalid: warps need accumulator rows
        s = {"block_m": 16, "block_n": bn, "block_k": 256, "num_warps": warps, "num_stages": stages, "group_m": 1,
             "split_k": 1, "persistent": 0}
    elif m <= 64:
        s = {"block_m": max(16, _p2(m)), "block_n": 128, "block_k": 128, "num_warps": 4,
             "num_stages": stages, "group_m": 8, "split_k": 1, "persistent": 0}
    else:
        # Wide tiles feed Hopper's warpgroup MMA best; older matrix units prefer square 128 tiles. A k
        # step is 128 bytes of a row; 16-bit operands come by TMA where the target has it (the H200's
        # M = 256 and 4096 records: 1-byte operands 128 deep, 4 stages, 1.2-2.1x faster than 64 deep;
        # 16-bit ones 3-12% faster by TMA).
        wide = (target.capability >= 90
                and -(-m // 128) * -(-n // 256) >= sms)  # and the wide tiles still fill the SMs
        one_byte = operand_bytes(wl) == 1
        tma = int(not one_byte and 1 in kn["tma"] and tma_operands(wl) is not None)
        s = {"block_m": 128, "block_n": 256 if wide else 128, "block_k": 128 if one_byte else 64, "num_warps": 8,
             "num_stages": (4 if one_byte else 3) if target.vendor != "amd" else stages, "group_m": 8,
             "split_k": 1, "persistent": 0, "tma": tma}
        if target.capability >= 90 and -(-m // 128) * -(-n // 128) <= sms // 2:
            # 128 x 128 tiles would leave half the SMs idle (256 rows of a 4096-wide weight: 64 tiles on
            # 132 SMs): 64-row tiles, 128 k a step, 4 stages. The H200's and H100's records at M = 256,
            # N = 4096: bf16 o 22.0 against 37.3 us and down 55.6 against 110.9 (the 64 x 128 x 64 tile
            # of 3 stages took 34.9 and 104.1: the deeper steps count as much), W8A8 down 39.6-45.6
            # against 61.9 (H100), fp8 down 33.6 against 101.7.
            s.update(block_m=64, block_n=128, block_k=128, num_stages=4)
    s = {**ADDED_KNOBS, **s}
    s["block_k"] = max(s["block_k"], min_block_k(wl))
    for key in ("block_m", "block_n", "block_k"):
        s[key] = max(v for v in kn[key] if v <= s[key]) if any(v <= s[key] for v in kn[key]) else kn[key][0]
    while _flat_invalid(wl, target, s):
        threads = s["num_warps"] * target.warp_size
        idle = s["block_m"] < MMA_MIN_ROWS and s["block_m"] * s["block_n"] * s["block_k"] < threads * MIN_PRODUCTS_PER_THREAD
        if idle and s["num_warps"] > 2:
            s["num_warps"] //= 2  # a GEMV tile of a short K: fewer threads, not shallower steps
        elif idle and s["block_n"] < kn["block_n"][-1]:
            s["block_n"] *= 2  # and then wider (64-thread warps)
        elif s["num_stages"] > max(kn["num_stages"][0], min_stages(target, s)):
            s["num_stages"] -= 1
        elif s["block_k"] > max(kn["block_k"][0], min_block_k(wl)):
            s["block_k"] //= 2
        elif s["num_warps"] < 8 and s["block_m"] * s["block_n"] > s["num_warps"] * target.warp_size * MAX_ACC_PER_THREAD:
            s["num_warps"] *= 2
        elif s["block_m"] >= MMA_MIN_ROWS and max(s["block_m"], s["block_n"]) > 64:
            # pipelined tiles too big for shared memory at the fewest stages (a fused norm's A tile
            # loads its weight too): the longer side halves, not the warps, which the accumulator needs
            side = "block_m" if s["block_m"] >= s["block_n"] else "block_n"
            s[side] //= 2
        elif s["num_warps"] > 2:
            s["num_warps"] //= 2
        else:
            break
    return s


def variants(wl: Workload, target: Target) -> dict[str, dict[str, tuple[int, ...]]]:
    """Each generator form the workload and target offer (flashgen/ir/variants.py), with the values of
    the knobs it reads. Forms the rules refuse whole are not offered (a generic matrix tile on `lanes`
    codes), and values the rules refuse for a whole form are left out of it: matrix tiles have
    16 rows or more, NVIDIA's pipelined stages (`min_stages`) and k steps of at most MAX_MMA_BLOCK_K
    (MAX_TMA_BOX with TMA copies); Gluon tiles whole warpgroups and k steps of SWIZZLE_BYTES rows (a ping-pong's consumers one each, taking turns only when persistent);
    a Gluon int4 k step one block of words."""
    kn = _flat_knobs(wl, target)
    rows = extents(wl)[0]
    scales = group_scales(wl)
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for v in VARIANTS.values():
        options = flat({"variant": v.name}, scales)
        if v.name.startswith(DEQUANT) or any(options[k] not in kn[k] for k in OPTIONS):
            continue
        if v.gluon and not _gluon_form_offered(wl, v.name):
            continue
        if v.gemv and options["ptx_unpack"] and not whole_block_groups(wl):
            continue  # PTX-unpacked GEMV tiles pair codes 64 k apart
        if not v.gemv and not options["lanes"] and int8_lanes(wl):
            continue  # `lanes` codes: matrix tiles are lanes tiles (`_flat_invalid` says why)
        values = {k: kn[k] for k in reads(v, rows)}
        values["block_m"] = tuple(b for b in kn["block_m"] if (b < MMA_MIN_ROWS) == v.gemv)
        if not values["block_m"]:
            continue
        if not v.gemv:
            values["block_k"] = tuple(b for b in kn["block_k"] if b <= MAX_MMA_BLOCK_K)
            if target.vendor != "amd":
                values["num_stages"] = tuple(st for st in kn["num_stages"] if st >= 2)
        if v.option("tma"):
            values["block_k"] = tuple(b for b in values["block_k"] if b <= MAX_TMA_BOX)
        if v.option("lanes"):
            values["block_k"] = tuple(b for b in values["block_k"] if lane_segment(wl, b))
        if v.gluon:
            values["num_warps"] = tuple(w for w in kn["num_warps"] if w % WARPGROUP == 0)
            if v.name == "gluon_lanes":
                values["block_k"] = tuple(b for b in values["block_k"] if b % (2 * LANE_BLOCK) == 0
                                          and b // 2 <= SWIZZLE_BYTES)
                values["block_m"] = tuple(b for b in values["block_m"] if b <= GLUON_INT8_MAX_N)
            elif v.name != "gluon_int4":
                values["block_k"] = tuple(b for b in values["block_k"] if b * operand_bytes(wl) <= SWIZZLE_BYTES)
        if v.option("consumers") > 1:
            values.update(num_warps=(WARPGROUP,), persistent=tuple(p for p in kn["persistent"] if p))
        if v.name == "gluon_int4":
            values["block_k"] = (INT4_PERIOD,)
        out[v.name] = values
    dense = dequant_first_form(wl)
    if dense is not None:  # dequantized first, the dense op's tiles (16-bit k steps of 32 and 64, TMA)
        for name, values in variants(dense, target).items():
            staged = VARIANTS.get(DEQUANT + name)
            if staged is not None:
                out[staged.name] = {**values, **({"dequant_chunks": (1, 2, 4, 8)} if "dequant_chunks" in staged.counts else {})}
    return out


def _gluon_form_offered(wl: Workload, name: str) -> bool:
    """Whether Gluon variant `name` reads the workload's operands: the dense tiles plain ones, gluon_int4
    int4 code words, gluon_lanes `lanes` codes."""
    if name == "gluon_int4":
        return bool(gluon_int4_operands(wl))
    if name == "gluon_lanes":
        return bool(gluon_lane_operands(wl))
    return bool(tma_operands(wl))


def group_scales(wl: Workload) -> bool:
    """Whether the workload's int4 codes have per-group scales (a Gluon int4 or lanes tile multiplies
    them into the codes)."""
    affine = int4_affine(wl)
    return (bool(affine) and affine[2] is not None) or lane_group_scales(wl)


def flat_of(wl: Workload, s: dict[str, Any]) -> dict[str, int]:
    """Variant-form schedule `s` spelled out flat: what the rules and the cost model's features read."""
    return flat(s, group_scales(wl))


def current(wl: Workload, s: dict[str, Any]) -> dict[str, Any]:
    """`s` in today's form: a schedule of the flat form records were written in before variants
    (missing the knobs added since, ADDED_KNOBS) as its variant form; where no form has its options,
    `s` as it is, which the space refuses as the rules always did. A variant-form schedule tuned at
    another row count gets group_m as `wl`'s rows read it (`reads`): 1 where a 16-row record, which
    has one row of tiles and no group_m, serves 32 rows; none where a 64-row record serves 16, whose
    one row of tiles its group_m would not change. Without this a tile tuned at 16 rows served no
    call of 17-32 rows, and mixed's plan knew the 4-bit modes there by their rooflines only."""
    if "variant" in s:
        v = VARIANTS.get(s["variant"])
        if v is None or "group_m" not in v.counts:
            return dict(s)
        if "group_m" not in reads(v, extents(wl)[0]):
            return {k: val for k, val in s.items() if k != "group_m"}
        return {"group_m": COUNT_DEFAULTS["group_m"], **s}
    if not set(FLAT_KNOBS) <= set(s) | set(ADDED_KNOBS):
        return dict(s)
    mapped = from_flat({**ADDED_KNOBS, **s}, extents(wl)[0], group_scales(wl))
    return mapped if mapped is not None else dict(s)


def implied(wl: Workload, name: str) -> dict[str, int]:
    """The options and counts variant `name` does not read, with the value it stands for: a knob pinned
    by its flat name (`--fix tma=1`) keeps the variants it holds for."""
    v = VARIANTS[name]
    return {k: val for k, val in flat({"variant": name}, group_scales(wl)).items() if k not in v.counts}


def why_invalid(wl: Workload, target: Target, s: dict[str, Any]) -> str | None:
    """The rules, on a variant-form schedule whose knobs ScheduleSpace checked, or on a flat one that no
    variant has (`current` left it flat), which they refuse."""
    return _flat_invalid(wl, target, flat_of(wl, s) if "variant" in s else {**ADDED_KNOBS, **s})


def why_other_regime(wl: Workload, s: dict[str, Any]) -> str | None:
    """Where schedule `s` (tuned at some row count) stops serving `wl`'s rows in its own regime: a GEMV
    tile (fewer than MMA_MIN_ROWS rows, summed on the ALUs) only where it covers every row, since each
    further row tile reads the whole weight again; a weight dequantized first only from
    DEQUANT_FIRST_MIN_M rows. Matrix tiles serve any row count the space allows them at."""
    f = flat_of(wl, s) if "variant" in s else {**ADDED_KNOBS, **s}
    m, bm = extents(wl)[0], f["block_m"]
    if bm < MMA_MIN_ROWS and bm < m:
        return f"a GEMV tile of {bm} row{'s' * (bm > 1)} cannot serve {m} rows"
    if f["dequant_first"] and m < DEQUANT_FIRST_MIN_M:
        return f"a weight dequantized first serves {DEQUANT_FIRST_MIN_M} rows or more, not {m}"
    return None


def why_not_bucket(wl: Workload, target: Target, s: dict[str, Any]) -> str | None:
    """Why a record of `s` tuned at another row count should not serve `wl`'s rows: another regime
    (`why_other_regime`), or, where the default's row tile covers every row (one pass over the weight:
    the memory-bound decode sizes) and its programs fill the SMs, a tile that does not cover them,
    since each further row tile reads and unpacks the weight again. Replayed from the H100's and
    H200's logs (benchmarks/studies/bucket_vs_default.py), records of such tiles lost to the default in
    all 10 such pairs, by 1.02-1.72x (16-row tiles at 32 and 64 rows); where the default left SMs idle
    (32-48 tiles on 132 SMs) they won two of four."""
    why = why_other_regime(wl, s)
    if why is not None:
        return why
    m, n = extents(wl)[:2]
    bm = (flat_of(wl, s) if "variant" in s else {**ADDED_KNOBS, **s})["block_m"]
    d = _flat_default(wl, target)
    programs = -(-m // d["block_m"]) * -(-n // d["block_n"]) * d.get("split_k", 1)
    if bm < m <= d["block_m"] and programs >= int(target.sm_count):
        return f"a tile of {bm} rows reads the weight {-(-m // bm)} times for {m} rows, the default's once"
    return None


def default(wl: Workload, target: Target) -> dict[str, Any]:
    """The analytic choice (`_flat_default`) in its variant form."""
    s = _flat_default(wl, target)
    mapped = from_flat(s, extents(wl)[0], group_scales(wl))
    assert mapped is not None, f"the default {s} has no variant"
    return mapped


def added_knobs(wl: Workload) -> dict[str, int]:
    """Knobs added after records were written, with the value their absence stands for (`current` reads
    such records)."""
    return ADDED_KNOBS
