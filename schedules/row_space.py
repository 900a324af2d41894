"""Schedule-space rules of the rowwise and pointwise kernel classes, and their analytic defaults.

A schedule is a plain JSON dict of knobs. Both classes tile the op's rows x cols domain:
- block_r: rows per program; several rows per program keep small rows from idling threads.
- block_c: columns per tile. For rowwise ops a tile that covers the whole row keeps the row in
  registers (one read of the input); a smaller tile loops over the row, re-reading it once per reduction.
  Pointwise ops tile the columns across programs (the class's `tiles_cols`).
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

from flashgen.ir import expr as E
from flashgen.ir.op import Store
from flashgen.kernel_classes import kernel_class
from flashgen.targets.descriptor import Target
from flashgen.workload import Schedule, Workload, domain

MAX_ELEMS_PER_THREAD = 64   # fp32 values a thread holds per live tensor before spills become likely
MIN_ELEMS_PER_THREAD = 4     # fewer leaves 16-byte loads unused and most of each warp's work idle
MAX_TILE = 1 << 14           # elements of one tile
MIN_LOOPED_TILE = 256        # a row walked in tiles narrower than this only adds loop overhead
WARPS = (1, 2, 4, 8, 16, 32)
CPU_MAX_BLOCK_C = 128        # cpu: widest column tile (elements) worth a vector operation
CPU_TASK_ELEMENTS = 2048     # cpu default: elements of work per parallel task, at least


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _tiles_cols(wl: Workload) -> bool:
    return kernel_class(wl.op.kclass).tiles_cols


def knobs(wl: Workload, target: Target) -> dict[str, tuple[int, ...]]:
    rows, cols = domain(wl)
    pc, pr = next_pow2(cols), next_pow2(rows)
    block_c = tuple(b for b in (2 ** i for i in range(17)) if b <= pc and (b >= 16 or b == pc))
    block_r = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= pr)
    return {"block_r": block_r, "block_c": block_c, "num_warps": WARPS}


def added_knobs(wl: Workload) -> dict[str, int]:
    return {}


def why_invalid(wl: Workload, target: Target, s: Schedule) -> str | None:
    threads = s["num_warps"] * target.warp_size
    tile = s["block_r"] * s["block_c"]
    if target.backend == "triton":
        if threads > target.get("max_threads_per_block", 1024):
            return f"{threads} threads exceed the target's {target.get('max_threads_per_block')}"
        if tile < threads * MIN_ELEMS_PER_THREAD and s["num_warps"] > 1:
            return f"tile of {tile} elements leaves some of {threads} threads idle"
        if tile > MAX_TILE or tile > threads * MAX_ELEMS_PER_THREAD:
            return f"tile of {tile} elements is too large for {threads} threads"
        rows, cols = domain(wl)
        if not _tiles_cols(wl) and s["block_c"] < min(cols, MIN_LOOPED_TILE):
            return f"a row of {cols} walked in tiles of {s['block_c']} only adds loop overhead"
    elif s["num_warps"] != 1:
        return "cpu schedules use num_warps=1"
    elif s["block_c"] > CPU_MAX_BLOCK_C:
        return f"block_c={s['block_c']} is wider than the cpu's vector tiles (at most {CPU_MAX_BLOCK_C})"
    return None


def _unpacks_words(wl: Workload) -> bool:
    """Whether the op shifts codes out of loaded words (int4 weights packed into int32)."""
    values = [st.value for st in wl.op.body(wl.attr) if isinstance(st, Store)]
    return any(isinstance(n, E.Binary) and n.op == "shr" and isinstance(n.a, E.Load) for v in values for n in E.walk(v))


def default(wl: Workload, target: Target) -> Schedule:
    """Analytic choice: whole row per tile up to 8192 elements, 16-byte loads per thread, enough
    rows per program to give every thread work, warps to keep ~8 elements per thread."""
    rows, cols = domain(wl)
    pc = next_pow2(cols)
    if target.backend != "triton":
        # cpu: tiles of 64 columns (4 AVX-512 / 8 AVX2 vectors, measured best or near it for every op),
        # and enough rows per task for about CPU_TASK_ELEMENTS elements of work.
        block_c = min(pc, 64)
        block_r = min(next_pow2(rows), 64, next_pow2(max(1, CPU_TASK_ELEMENTS // cols)))
        return {"block_r": block_r, "block_c": block_c, "num_warps": 1}
    tiles_cols = _tiles_cols(wl)
    if tiles_cols and _unpacks_words(wl):
        # Codes come eight to a loaded word: a thread holding 64 consecutive columns loads each of
        # its words once for four of its codes (the H200's dequant_w4a16 records on the five Llama
        # weights: 2048 columns and one warp 1.5-1.8x faster than 8 columns a thread).
        block_c = min(pc, 2048)
        warps = max(1, block_c // (MAX_ELEMS_PER_THREAD * target.warp_size))
        return {"block_r": 1, "block_c": block_c, "num_warps": warps}
    block_c = min(pc, 1024 if tiles_cols else 8192)
    block_r = min(next_pow2(rows), max(1, 1024 // block_c), knobs(wl, target)["block_r"][-1])
    tile = block_r * block_c
    warps = max(1, min(4 if tiles_cols else 16, tile // (8 * target.warp_size)))
    warps = 1 << (warps.bit_length() - 1)
    return {"block_r": block_r, "block_c": block_c, "num_warps": warps}
