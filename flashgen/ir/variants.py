"""The contraction generators' forms: a schedule's `variant` names which generator writes its kernel and
in which form, and so which knobs it reads.

Both the space (schedules/contraction_space.py: each variant's knob values and rules) and the
generators (targets/triton/contraction, targets/gluon, targets/staged.py: the form's options) read this
table, which sits below both. A schedule holds the variant and the knobs its generator reads, no more:
a GEMV tile has no TMA, Gluon or dequant knob. `flat` spells a schedule out with every option and every
count (the form records were written in before variants, which the rules and the cost model's features
still speak); `from_flat` reads such a record back as its variant form.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from flashgen.ir.contraction import MMA_MIN_ROWS

# Counts a variant may leave out, and the value their absence stands for: one row tile at a time (or
# one row of tiles, where grouping changes nothing), an unsplit K, one program per tile, one chunk.
COUNT_DEFAULTS = {"group_m": 1, "split_k": 1, "persistent": 0, "dequant_chunks": 1}
# The knobs that choose a form rather than a size, as flat schedules spell them (0: off), with their
# value where a form leaves them off.
OPTIONS = {"backend": 0, "tma": 0, "ptx_unpack": 0, "operand_scale": 0, "early_load": 0, "producer_warps": 0,
           "consumers": 1, "tma_store": 0, "dequant_first": 0, "lanes": 0}
TILE = ("block_m", "block_n", "block_k", "num_warps", "num_stages")  # every form reads these
GLUON = 1  # `backend` of the Gluon generator (flashgen/kernel_classes.py SCHEDULE_BACKENDS)
DEQUANT = "dq_"  # a weight dequantized first, then the dense op's tile of the rest of the name


@dataclass(frozen=True)
class Variant:
    """One generator form: its options (OPTIONS' names; those not given are off), whether its tiles are
    GEMVs summed on the ALUs (fewer than MMA_MIN_ROWS rows), and the counts it reads besides TILE."""
    name: str
    options: Mapping[str, int] = field(default_factory=dict)
    gemv: bool = False
    counts: tuple[str, ...] = ("group_m", "split_k", "persistent")

    def option(self, name: str) -> int:
        return self.options.get(name, OPTIONS[name])

    @property
    def gluon(self) -> bool:
        return self.option("backend") == GLUON

    @property
    def reads(self) -> tuple[str, ...]:
        return TILE + self.counts


def _table() -> dict[str, Variant]:
    ptx, early = {"ptx_unpack": 1}, {"early_load": 1}
    gemv = [Variant("gemv", gemv=True), Variant("gemv_ptx", ptx, gemv=True),
            Variant("gemv_ptx_quad", {"ptx_unpack": 2}, gemv=True)]
    # early loads peel the first k step before the wait: unsplit, one program per tile
    gemv += [Variant(f"{v.name}_early", {**v.options, **early}, True, ("group_m",)) for v in gemv]
    tile = [Variant("tile"), Variant("tile_tma", {"tma": 1})]
    int4 = [Variant("tile_ptx", ptx), Variant("tile_ptx_scaled", {**ptx, "operand_scale": 1})]
    # int4 codes of the `lanes` layout: one AND per four int8 lanes, int8 matrix instructions
    int4 += [Variant("tile_lanes", {"lanes": 1})]
    # and each group's integer scale multiplied into its lanes before the instruction: one int32 sum
    int4 += [Variant("tile_lanes_scaled", {"lanes": 1, "operand_scale": 1})]
    g = {"backend": GLUON}
    warp = {**g, "producer_warps": 1}
    gluon = [Variant("gluon", g, counts=("group_m",)), Variant("gluon_warp", warp, counts=("group_m", "persistent")),
             Variant("gluon_pingpong", {**warp, "consumers": 2}, counts=("group_m", "persistent"))]
    gluon += [Variant(f"{v.name}_store", {**v.options, "tma_store": 1}, counts=v.counts) for v in gluon]
    # int4 codes copied as words: a producer warp, PTX unpacking; the scale's place is the workload's
    gluon_codes = [Variant("gluon_int4", {**warp, "ptx_unpack": 1}, counts=("group_m", "split_k"))]
    # `lanes` codes copied as bytes: a producer warp, int8 warpgroup MMAs; the scale's place is the workload's
    gluon_codes += [Variant("gluon_lanes", {**warp, "lanes": 1}, counts=("group_m", "split_k"))]
    # a weight dequantized first runs a dense form's tiles; Triton's in chunks, Gluon's in one
    staged = [replace(v, name=DEQUANT + v.name, options={**v.options, "dequant_first": 1},
                      counts=v.counts + (() if v.gluon else ("dequant_chunks",))) for v in tile + gluon]
    return {v.name: v for v in gemv + tile + int4 + gluon + gluon_codes + staged}


VARIANTS = _table()


def reads(v: Variant, rows: int) -> tuple[str, ...]:
    """The knobs `v` reads for a workload of `rows` rows: group_m only where its smallest tile leaves more
    than one row of tiles (with one, grouping row tiles changes nothing)."""
    smallest = 1 if v.gemv else MMA_MIN_ROWS
    return tuple(k for k in v.reads if k != "group_m" or rows > smallest)


def variant(s: Mapping[str, Any]) -> Variant:
    """The form of variant-form schedule `s`."""
    return VARIANTS[s["variant"]]


def count(s: Mapping[str, Any], name: str) -> int:
    """A count knob of `s`, or the value its absence stands for."""
    return s.get(name, COUNT_DEFAULTS[name])


def dense_schedule(s: Mapping[str, Any]) -> dict[str, Any]:
    """The dense op's schedule inside a schedule that dequantizes first (its tiles, without the chunks)."""
    return {**{k: v for k, v in s.items() if k != "dequant_chunks"}, "variant": s["variant"][len(DEQUANT):]}


def flat(s: Mapping[str, Any], group_scales: bool = False) -> dict[str, int]:
    """`s` with every option and count spelled out, as records were written before variants.
    `group_scales`: the workload's int4 scales are per group (a Gluon int4 or lanes tile multiplies them
    into the codes: operand_scale 1; per channel, into the sum)."""
    v = variant(s)
    out = {**OPTIONS, **v.options, **COUNT_DEFAULTS, **{k: val for k, val in s.items() if k != "variant"}}
    if v.name in ("gluon_int4", "gluon_lanes"):
        out["operand_scale"] = int(group_scales)
    return out


def from_flat(s: Mapping[str, Any], rows: int, group_scales: bool = False) -> dict[str, Any] | None:
    """The variant form of flat schedule `s` (every option and count present) for a workload of `rows`
    rows, or None where no form has its options, or where it sets a count its form never reads to other
    than its default (a combination the rules always refused). A count the form reads but that changes
    nothing for this workload (`reads`) is dropped whatever its value."""
    gemv = s["block_m"] < MMA_MIN_ROWS
    for v in VARIANTS.values():
        want = flat({"variant": v.name}, group_scales)
        if v.gemv != gemv or any(s[k] != want[k] for k in OPTIONS):
            continue
        if any(s[k] != COUNT_DEFAULTS[k] for k in COUNT_DEFAULTS if k not in v.counts):
            return None
        return {"variant": v.name, **{k: s[k] for k in reads(v, rows)}}
    return None
