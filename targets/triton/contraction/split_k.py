"""Split K: programs sharing one tile's k range, the last to finish merging their partial tiles."""
from __future__ import annotations

from flashgen.targets.triton.contraction.context import ACC
from flashgen.targets.triton.emit import Scope, Scratch


def split_scratch(bm: int, bn: int, split_k: int, acc: str) -> tuple[Scratch, ...]:
    """Per (tile, split) the partial accumulator tile, and per tile a counter of finished splits."""
    tiles = lambda d: -(-d["M"] // bm) * -(-d["N"] // bn)  # noqa: E731
    return (Scratch("part", "fp32" if acc == "fp32" else "int32", lambda d: tiles(d) * split_k * bm * bn),
            Scratch("done", "int32", tiles, zeroed=True))


def merge_splits(top: Scope, acc: str, acc_type: str, layout: str | None = None) -> Scope:
    """Each split stores its partial tile; the last split of a tile to finish adds all of them in
    split order (the sum does not depend on which finished last), resets the tile's counter, and
    returns the scope (inside its branch) where the epilogue goes. `layout` names the accumulator's
    distributed layout where the source gives layouts explicitly (Gluon, targets/gluon/int4.py)."""
    rows, cols, zeros, barrier = "tl.arange(0, BLOCK_M)", "tl.arange(0, BLOCK_N)", f"dtype={ACC[acc_type]}", \
        "tl.debug_barrier()"
    if layout:
        rows = f"tl.arange(0, BLOCK_M, layout=tl.SliceLayout(1, {layout}))"
        cols = f"tl.arange(0, BLOCK_N, layout=tl.SliceLayout(0, {layout}))"
        zeros, barrier = f"{ACC[acc_type]}, {layout}", "tl.thread_barrier()"
    top.line(f"offs = {rows}[:, None] * BLOCK_N + {cols}[None, :]")
    top.line(f"tl.store(part_ptr + (pid * SPLIT_K + split).to(tl.int64) * (BLOCK_M * BLOCK_N) + offs, {acc})")
    top.line(barrier)
    top.line("finished = tl.atomic_add(done_ptr + pid, 1)  # acq_rel at gpu scope")
    top.line("if finished == SPLIT_K - 1:")
    last = top.child(top.indent + "    ")
    last.line(barrier)
    last.line(f"{acc} = tl.zeros([BLOCK_M, BLOCK_N], {zeros})")
    last.line("for i in tl.static_range(SPLIT_K):")
    last.line(f"    {acc} += tl.load(part_ptr + (pid * SPLIT_K + i).to(tl.int64) * (BLOCK_M * BLOCK_N) + offs, volatile=True)")
    last.line("tl.atomic_xchg(done_ptr + pid, 0)")
    return last
