"""Schedule-space rules of the attention class (paged decode and packed-sequence prefill), and its
analytic defaults. The statement's kind (`Attend.kind`) picks one of two spaces.

Decode: `pages` cache blocks per loop step (more keys in flight per program), warps, stages; `splits`
shares one sequence's context among programs (flash-decoding) when B x Hkv < the SMs; `early_kv`
(targets with programmatic dependent launch): the keys before each query's own position are read before
waiting for the previous kernel (targets/triton/attention.py says when that holds).
Prefill: query rows and key columns per tile, warps, stages; `tma` (sm_90): key and value tiles copied
by TMA descriptors. Rules: the pipelined key/value tiles fit the shared memory and the output
accumulator fits the warps' registers. On sm_90, packed prefill (no cached prefix) also has the Gluon
kernel (targets/gluon/attention.py): `backend` 1, a producer warp feeding `consumers` (1, 2) warpgroups
of 64 query rows each (block_m = 64 x consumers, 4 warps), which with `pingpong` take turns at the
tensor cores, in one program per query tile or (`persistent`) one per SM walking the tiles; its rules: power-of-two head dims, a ring of at least two slots, and each consumer's
logits and output tile in its registers.
"""
from __future__ import annotations

from flashgen.ir.contraction import WARPGROUP, WARPGROUP_ROWS
from flashgen.ir.op import Attend
from flashgen.targets.descriptor import Target
from flashgen.schedules.contraction_space import gluon_target
from flashgen.schedules.row_space import next_pow2
from flashgen.workload import Schedule, Workload

MAX_ELEMS_PER_THREAD = 64   # fp32 accumulator values a thread holds before spills become likely
DECODE_KNOBS = {"pages": (1, 2, 4, 8), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3),
                "splits": (1, 2, 4, 8, 16, 32)}
DECODE_ADDED = {"early_kv": 0}   # records written before `early_kv` existed read as early_kv=0
PREFILL_KNOBS = {"block_m": (32, 64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3)}
PREFILL_ADDED = {"tma": 0, "backend": 0, "consumers": 1, "pingpong": 0, "persistent": 0}  # and before them, as these
GLUON_ROWS = WARPGROUP * WARPGROUP_ROWS  # query rows per consumer warpgroup of the Gluon kernel
GLUON_TILE_REGS = 128  # fp32 logits + output values a consumer thread holds: (block_n + D) / 2 at most


def _kind(wl: Workload) -> str:
    return next(st.kind for st in wl.op.body(wl.attr) if isinstance(st, Attend))


def knobs(wl: Workload, target: Target) -> dict[str, tuple[int, ...]]:
    if _kind(wl) == "decode":
        return {**DECODE_KNOBS, "early_kv": (0, 1) if target.pdl else (0,)}
    gluon = gluon_target(target) and _packed(wl)
    return {**PREFILL_KNOBS, "tma": (0, 1) if target.capability >= 90 else (0,), "backend": (0, 1) if gluon else (0,),
            "consumers": (1, 2) if gluon else (1,), "pingpong": (0, 1) if gluon else (0,),
            "persistent": (0, 1) if gluon else (0,)}


def _packed(wl: Workload) -> bool:
    """Packed new tokens only (no prefix in a paged cache): the sequences the Gluon kernel serves."""
    return "prefix_lens" not in wl.op.tensors


def _gluon_invalid(wl: Workload, target: Target, s: Schedule) -> str | None:
    """The Gluon prefill kernel's rules (targets/gluon/attention.py), or None."""
    d = wl.dim["D"]
    if not (gluon_target(target) and _packed(wl)):
        return "Gluon prefill builds for NVIDIA sm_90, on packed sequences (no cached prefix)"
    if s["tma"]:
        return "the Gluon prefill makes its own TMA copies (tma=0)"
    if s["num_warps"] != WARPGROUP or s["block_m"] != GLUON_ROWS * s["consumers"]:
        return (f"a Gluon prefill consumer is one warpgroup ({WARPGROUP} warps) of {GLUON_ROWS} query rows: "
                f"block_m = {GLUON_ROWS} x consumers")
    if s["pingpong"] and s["consumers"] != 2:
        return "ping-pong takes two consumers"
    if s["num_stages"] < 2:
        return "a consumer holds one key/value slot while the next is copied: num_stages >= 2"
    if d != next_pow2(d) or d < 16:
        return f"the Gluon prefill takes power-of-two head dims (D={d})"
    if (s["block_n"] + d) // 2 > GLUON_TILE_REGS:
        return f"block_n={s['block_n']} logits and D={d} outputs per row exceed a consumer's registers"
    return None


def added_knobs(wl: Workload) -> dict[str, int]:
    return PREFILL_ADDED if _kind(wl) == "prefill" else DECODE_ADDED


def why_invalid(wl: Workload, target: Target, s: Schedule) -> str | None:
    if _kind(wl) != "prefill":
        return None
    if not s["backend"] and (s["consumers"] > 1 or s["pingpong"] or s["persistent"]):
        return "consumer warpgroups, ping-pong and persistent programs serve the Gluon prefill (backend 1)"
    if s["backend"] and (why := _gluon_invalid(wl, target, s)):
        return why
    d = next_pow2(wl.dim["D"])  # the tiles' head dim: padded to a power of two
    smem = s["num_stages"] * 2 * s["block_n"] * d * 2 + s["block_m"] * d * 2
    if smem > int(target.get("smem_per_block", 0)):
        return f"{smem} bytes of key/value tiles exceed the shared memory"
    if not s["backend"] and s["block_m"] * d > s["num_warps"] * target.warp_size * MAX_ELEMS_PER_THREAD:
        return "the output accumulator does not fit the warps' registers"
    return None


def default(wl: Workload, target: Target) -> Schedule:
    if _kind(wl) == "decode":
        d = wl.dim
        programs = d["B"] * d["Hkv"]
        splits = 1
        while splits < 32 and programs * splits < target.sm_count and d["L"] // (splits * 2) >= 512:
            splits *= 2
        return {"pages": 2, "num_warps": 4, "num_stages": 2, "splits": splits, **DECODE_ADDED}
    # 64x64 tiles, double-buffered where the shared memory allows (not at D=128 on AMD's 64 KB), with
    # 8 warps where 4 cannot hold the accumulator (heads padded to 256 on 32-lane warps).
    for warps in (4, 8):
        for stages, block_n in ((2, 64), (1, 64), (1, 32)):
            s = {"block_m": 64, "block_n": block_n, "num_warps": warps, "num_stages": stages, **PREFILL_ADDED}
            if why_invalid(wl, target, s) is None:
                return s
    return {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1, **PREFILL_ADDED}
