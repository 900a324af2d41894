"""Schedule spaces of the rowwise and pointwise kernel classes, and their analytic defaults.

A schedule is a plain JSON dict of knobs. Both classes tile the op's rows x cols domain:
- block_r: rows per program; several rows per program keep small rows from idling threads.
- block_c: columns per tile. For rowwise ops a tile that covers the whole row keeps the row in
  registers (one read of the input); a smaller tile loops over the row, re-reading it once per reduction.
- num_warps: threads per program / warp size.
Validity rules bound the work per thread (too little idles lanes, too much spills registers) and the
threads per program by the target's limit.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator

from flashgen.targets.descriptor import Target
from flashgen.workload import Workload
from flashgen.ir.op import eval_int

Schedule = dict[str, Any]

MAX_ELEMS_PER_THREAD = 64   # fp32 values a thread holds per live tensor before spills become likely
MAX_TILE = 1 << 16           # elements of one tile
WARPS = (1, 2, 4, 8, 16, 32)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def domain(wl: Workload) -> tuple[int, int]:
    rows, cols = wl.op.domain
    return eval_int(rows, wl.dim), eval_int(cols, wl.dim)


@dataclass(frozen=True)
class ScheduleSpace:
    """The knobs of one kernel class for one workload on one target, with their validity rules."""
    workload: Workload
    target: Target

    @property
    def kclass(self) -> str:
        return self.workload.op.kclass

    def knobs(self) -> dict[str, tuple[int, ...]]:
        rows, cols = domain(self.workload)
        pc, pr = next_pow2(cols), next_pow2(rows)
        block_c = tuple(b for b in (2 ** i for i in range(17)) if b <= pc and (b >= 16 or b == pc))
        block_r = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= pr)
        return {"block_r": block_r, "block_c": block_c, "num_warps": WARPS}

    def is_valid(self, s: Schedule) -> bool:
        return self.why_invalid(s) is None

    def why_invalid(self, s: Schedule) -> str | None:
        knobs = self.knobs()
        if set(s) != set(knobs):
            return f"schedule knobs must be {sorted(knobs)}, got {sorted(s)}"
        for k, v in s.items():
            if v not in knobs[k]:
                return f"{k}={v} is not one of {knobs[k]}"
        threads = s["num_warps"] * self.target.warp_size
        tile = s["block_r"] * s["block_c"]
        if self.target.backend == "triton":
            if threads > self.target.get("max_threads_per_block", 1024):
                return f"{threads} threads exceed the target's {self.target.get('max_threads_per_block')}"
            if tile < threads and s["num_warps"] > 1:
                return f"tile of {tile} elements leaves some of {threads} threads idle"
            if tile > MAX_TILE or tile > threads * MAX_ELEMS_PER_THREAD:
                return f"tile of {tile} elements is too large for {threads} threads"
        elif s["num_warps"] != 1:
            return "cpu schedules use num_warps=1"
        return None

    def __iter__(self) -> Iterator[Schedule]:
        knobs = self.knobs()
        for values in itertools.product(*knobs.values()):
            s = dict(zip(knobs, values))
            if self.is_valid(s):
                yield s

    def default(self) -> Schedule:
        """Analytic choice: whole row per tile up to 8192 elements, 16-byte loads per thread, enough
        rows per program to give every thread work, warps to keep ~8 elements per thread."""
        rows, cols = domain(self.workload)
        pc = next_pow2(cols)
        if self.target.backend != "triton":
            return {"block_r": 1, "block_c": min(pc, 1024), "num_warps": 1}
        if self.kclass == "rowwise":
            block_c = min(pc, 8192)
        else:
            block_c = min(pc, 1024)
        block_r = min(next_pow2(rows), max(1, 1024 // block_c))
        tile = block_r * block_c
        warps = max(1, min(16 if self.kclass == "rowwise" else 4, tile // (8 * self.target.warp_size)))
        warps = 1 << (warps.bit_length() - 1)
        s = {"block_r": block_r, "block_c": block_c, "num_warps": warps}
        assert self.is_valid(s), (s, self.why_invalid(s))
        return s
