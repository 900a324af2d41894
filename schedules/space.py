"""Schedule spaces of the rowwise and pointwise kernel classes, and their analytic defaults.

A schedule is a plain JSON dict of knobs. Both classes tile the op's rows x cols domain:
- block_r: rows per program; several rows per program keep small rows from idling threads.
- block_c: columns per tile. For rowwise ops a tile that covers the whole row keeps the row in
  registers (one read of the input); a smaller tile loops over the row, re-reading it once per reduction.
- num_warps: threads per program / warp size.
Validity rules bound the work per thread (too little idles lanes, too much spills registers) and the
threads per program by the target's limit.

On the cpu target (TVM backend, LLVM) the same knobs mean:
- block_r: rows per parallel task. Rows are independent; the kernel's `T.parallel` loop runs over
  ceil(M / block_r) tasks, which TVM's thread pool splits evenly among its threads (a call with fewer
  than 65536 elements in its domain runs the same tasks serially: a parallel launch costs ~5 us).
  Small rows want several per task so that loop overhead stays small next to the work.
- block_c: the column tile, in elements, processed as one vector operation (LLVM splits a tile of 64
  fp32 into 4 AVX-512 or 8 AVX2 instructions, which also unrolls the loop). A reduction keeps block_c
  partial results, so a wider tile gives more independent accumulators. Every rowwise op walks its row
  once per reduction (rows live in L1/L2, so the re-reads are cache hits) and the ragged end of a row
  is one narrower vector loop, never masked lanes. At most CPU_MAX_BLOCK_C: wider tiles spill registers
  and slow compilation without gaining speed.
- num_warps: always 1.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Iterator

from flashgen.errors import FlashgenError
from flashgen.schedules import contraction_space
from flashgen.targets.descriptor import Target
from flashgen.workload import Schedule, Workload, domain
from flashgen.ir import expr as E
from flashgen.ir.op import Store, eval_int

MAX_ELEMS_PER_THREAD = 64   # fp32 values a thread holds per live tensor before spills become likely
MIN_ELEMS_PER_THREAD = 4     # fewer leaves 16-byte loads unused and most of each warp's work idle
MAX_TILE = 1 << 14           # elements of one tile
MIN_LOOPED_TILE = 256        # a row walked in tiles narrower than this only adds loop overhead
WARPS = (1, 2, 4, 8, 16, 32)
# Paged decode attention: cache blocks per loop step (more keys in flight per program), warps, stages.
# `splits` shares one sequence's context among programs (flash-decoding) when B x Hkv < the SMs.
DECODE_KNOBS = {"pages": (1, 2, 4, 8), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3),
                "splits": (1, 2, 4, 8, 16, 32)}
# `early_kv` (targets with programmatic dependent launch): the keys before each query's own position
# are read before waiting for the previous kernel (targets/triton/attention.py says when that holds).
# Records written before it existed read as early_kv=0.
DECODE_ADDED = {"early_kv": 0}
# Prefill: query rows and key columns per tile, warps, stages; `tma` (sm_90): key and value tiles copied
# by TMA descriptors. Records written before `tma` existed read as tma=0 (PREFILL_ADDED).
PREFILL_KNOBS = {"block_m": (32, 64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3)}
PREFILL_ADDED = {"tma": 0}
CPU_MAX_BLOCK_C = 128        # cpu: widest column tile (elements) worth a vector operation
CPU_TASK_ELEMENTS = 2048     # cpu default: elements of work per parallel task, at least


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class ScheduleSpace:
    """The knobs of one kernel class for one workload on one target, with their validity rules.

    `fixed` pins knobs to one value each ((name, value) pairs), so that a tune can study one knob on
    purpose (`flashgen tune --fix tma=1`) instead of waiting for the search to try it."""
    workload: Workload
    target: Target
    fixed: tuple[tuple[str, int], ...] = ()

    @property
    def kclass(self) -> str:
        return self.workload.op.kclass

    def knobs(self) -> dict[str, tuple[int, ...]]:
        knobs = self._all_knobs()
        for name, value in self.fixed:
            if name not in knobs:
                raise FlashgenError(f"fixed knob {name}: the {self.kclass} space has no such knob (knobs: {', '.join(knobs)})")
            if value not in knobs[name]:
                raise FlashgenError(f"fixed knob {name}={value}: not one of {knobs[name]} for {self.workload} on {self.target.id}")
            knobs[name] = (value,)
        return knobs

    def _all_knobs(self) -> dict[str, tuple[int, ...]]:
        if self.kclass == "contraction":
            return dict(contraction_space.knobs(self.workload, self.target))
        if self.kclass == "attention":
            if self._attention_kind() == "decode":
                return {**DECODE_KNOBS, "early_kv": (0, 1) if self.target.pdl else (0,)}
            return {**PREFILL_KNOBS, "tma": (0, 1) if self.target.capability >= 90 else (0,)}
        rows, cols = domain(self.workload)
        pc, pr = next_pow2(cols), next_pow2(rows)
        block_c = tuple(b for b in (2 ** i for i in range(17)) if b <= pc and (b >= 16 or b == pc))
        block_r = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= pr)
        return {"block_r": block_r, "block_c": block_c, "num_warps": WARPS}

    def is_valid(self, s: Schedule) -> bool:
        return self.why_invalid(s) is None

    def added_knobs(self) -> dict[str, int]:
        """Knobs added after records were written, with the value their absence stands for."""
        if self.kclass == "contraction":
            return contraction_space.ADDED_KNOBS
        if self.kclass != "attention":
            return {}
        return PREFILL_ADDED if self._attention_kind() == "prefill" else DECODE_ADDED

    def complete(self, s: Schedule) -> Schedule:
        """`s` with every added knob it predates set to the value its absence stands for."""
        return {**{k: v for k, v in self.added_knobs().items() if k not in s}, **s}

    def why_invalid(self, s: Schedule) -> str | None:
        knobs = self.knobs()
        s = self.complete(s)
        if set(s) != set(knobs):
            return f"schedule knobs must be {sorted(knobs)}, got {sorted(s)}"
        for k, v in s.items():
            if v not in knobs[k]:
                return f"{k}={v} is not one of {knobs[k]}"
        if self.kclass == "contraction":
            return contraction_space.why_invalid(self.workload, self.target, s)
        if self.kclass == "attention" and self._attention_kind() == "prefill":
            d = next_pow2(self.workload.dim["D"])  # the tiles' head dim: padded to a power of two
            smem = s["num_stages"] * 2 * s["block_n"] * d * 2 + s["block_m"] * d * 2
            if smem > int(self.target.get("smem_per_block", 0)):
                return f"{smem} bytes of key/value tiles exceed the shared memory"
            if s["block_m"] * d > s["num_warps"] * self.target.warp_size * MAX_ELEMS_PER_THREAD:
                return "the output accumulator does not fit the warps' registers"
        return None if self.kclass == "attention" else self._row_rules(s)

    def _row_rules(self, s: Schedule) -> str | None:
        threads = s["num_warps"] * self.target.warp_size
        tile = s["block_r"] * s["block_c"]
        if self.target.backend == "triton":
            if threads > self.target.get("max_threads_per_block", 1024):
                return f"{threads} threads exceed the target's {self.target.get('max_threads_per_block')}"
            if tile < threads * MIN_ELEMS_PER_THREAD and s["num_warps"] > 1:
                return f"tile of {tile} elements leaves some of {threads} threads idle"
            if tile > MAX_TILE or tile > threads * MAX_ELEMS_PER_THREAD:
                return f"tile of {tile} elements is too large for {threads} threads"
            rows, cols = domain(self.workload)
            if self.kclass == "rowwise" and s["block_c"] < min(cols, MIN_LOOPED_TILE):
                return f"a row of {cols} walked in tiles of {s['block_c']} only adds loop overhead"
        elif s["num_warps"] != 1:
            return "cpu schedules use num_warps=1"
        elif s["block_c"] > CPU_MAX_BLOCK_C:
            return f"block_c={s['block_c']} is wider than the cpu's vector tiles (at most {CPU_MAX_BLOCK_C})"
        return None

    def _unpacks_words(self) -> bool:
        """Whether the op shifts codes out of loaded words (int4 weights packed into int32)."""
        values = [st.value for st in self.workload.op.body(self.workload.attr) if isinstance(st, Store)]
        return any(isinstance(n, E.Binary) and n.op == "shr" and isinstance(n.a, E.Load) for v in values for n in E.walk(v))

    def _attention_kind(self) -> str:
        from flashgen.ir.op import Attend
        return next(st.kind for st in self.workload.op.body(self.workload.attr) if isinstance(st, Attend))

    def pinned_default(self) -> Schedule | None:
        """The default with the fixed knobs set, or None when that combination is not valid."""
        s = {**self.default(), **dict(self.fixed)}
        return s if self.is_valid(s) else None

    def __iter__(self) -> Iterator[Schedule]:
        knobs = self.knobs()
        for values in itertools.product(*knobs.values()):
            s = dict(zip(knobs, values))
            if self.is_valid(s):
                yield s

    def default(self) -> Schedule:
        """Analytic choice: whole row per tile up to 8192 elements, 16-byte loads per thread, enough
        rows per program to give every thread work, warps to keep ~8 elements per thread. Fixed knobs
        do not change it: it is the unrestricted space's default (`pinned_default` applies them)."""
        if self.fixed:
            return replace(self, fixed=()).default()
        if self.kclass == "contraction":
            s = contraction_space.default(self.workload, self.target)
            assert self.is_valid(s), (s, self.why_invalid(s))
            return s
        if self.kclass == "attention":
            if self._attention_kind() == "decode":
                d = self.workload.dim
                programs = d["B"] * d["Hkv"]
                splits = 1
                while splits < 32 and programs * splits < self.target.sm_count and d["L"] // (splits * 2) >= 512:
                    splits *= 2
                return {"pages": 2, "num_warps": 4, "num_stages": 2, "splits": splits, **DECODE_ADDED}
            # 64x64 tiles, double-buffered where the shared memory allows (not at D=128 on AMD's 64 KB), with
            # 8 warps where 4 cannot hold the accumulator (heads padded to 256 on 32-lane warps).
            for warps in (4, 8):
                for stages, block_n in ((2, 64), (1, 64), (1, 32)):
                    s = {"block_m": 64, "block_n": block_n, "num_warps": warps, "num_stages": stages, **PREFILL_ADDED}
                    if self.is_valid(s):
                        return s
            s = {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1, **PREFILL_ADDED}
            if not self.is_valid(s):
                raise FlashgenError(f"no prefill schedule fits {self.workload} on {self.target.id}: {self.why_invalid(s)}")
            return s
        rows, cols = domain(self.workload)
        pc = next_pow2(cols)
        if self.target.backend != "triton":
            # cpu: tiles of 64 columns (4 AVX-512 / 8 AVX2 vectors, measured best or near it for every op),
            # and enough rows per task for about CPU_TASK_ELEMENTS elements of work.
            block_c = min(pc, 64)
            block_r = min(next_pow2(rows), 64, next_pow2(max(1, CPU_TASK_ELEMENTS // cols)))
            return {"block_r": block_r, "block_c": block_c, "num_warps": 1}
        if self.kclass == "pointwise" and self._unpacks_words():
            # Codes come eight to a loaded word: a thread holding 64 consecutive columns loads each of
            # its words once for four of its codes (the H200's dequant_w4a16 records on the five Llama
            # weights: 2048 columns and one warp 1.5-1.8x faster than 8 columns a thread).
            block_c = min(pc, 2048)
            warps = max(1, block_c // (MAX_ELEMS_PER_THREAD * self.target.warp_size))
            return {"block_r": 1, "block_c": block_c, "num_warps": warps}
        if self.kclass == "rowwise":
            block_c = min(pc, 8192)
        else:
            block_c = min(pc, 1024)
        block_r = min(next_pow2(rows), max(1, 1024 // block_c), self.knobs()["block_r"][-1])
        tile = block_r * block_c
        warps = max(1, min(16 if self.kclass == "rowwise" else 4, tile // (8 * self.target.warp_size)))
        warps = 1 << (warps.bit_length() - 1)
        s = {"block_r": block_r, "block_c": block_c, "num_warps": warps}
        assert self.is_valid(s), (s, self.why_invalid(s))
        return s
