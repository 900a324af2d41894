"""What both Gluon contraction generators share (contraction.py: plain operands; int4.py: int4 codes):
the state every part of one kernel's generator reads, its start, and the op's epilogue."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from flashgen.ir import dtypes
from flashgen.ir.op import Contract, Let, Stmt, Store, eval_int
from flashgen.targets.gluon.emit import NS, GluonEmitter, module_header, module_text
from flashgen.targets.triton.emit import Arg, Scratch, Scope, kernel_args
from flashgen.workload import Schedule, Workload


@dataclass
class Tile:
    """One Gluon contraction kernel being written: its body and Contract, the emitter (the Contract's
    value is `acc`), the module's lines and arguments, `top` the kernel function's scope, `rows` and
    `cols` the output's extents as emitted there, and `cmask` the column mask where a tile can run
    past the last column."""
    wl: Workload
    s: Schedule
    body: tuple[Stmt, ...]
    con: Contract
    em: GluonEmitter
    name: str
    args: list[Arg]
    lines: list[str]
    top: Scope
    rows: str
    cols: str
    cmask: str | None

    def module(self, helpers: list[str]) -> str:
        """The finished module text, `helpers` (the partitions' functions) before the kernel."""
        return module_text(self.em, self.lines, helpers)


def start(wl: Workload, s: Schedule, consts: Mapping[str, int], scratch: tuple[Scratch, ...] = ()) -> Tile:
    """The module's header and the kernel's arguments (`consts` its constexprs, `scratch` its buffers
    besides the op's tensors), and the output's extents, which the tile counts and the epilogue's
    masks read."""
    op, attrs = wl.op, wl.attr
    body = op.body(attrs)
    [con] = [st for st in body if isinstance(st, Contract)]
    em = GluonEmitter(op, attrs, {st.name: st.value for st in body if isinstance(st, Let)})
    em.named[con.name] = "acc"
    name = f"{op.name}_kernel"
    args = kernel_args(wl, consts, scratch)
    lines = module_header(wl, s, name, args)
    m_extent, n_extent = op.domain
    cmask = "cmask" if eval_int(n_extent, wl.dim) % s["block_n"] else None
    top = Scope(lines, "    ", {"r": ("r", "rmask"), "c": ("c", cmask)})
    rows, cols = em.emit(m_extent, top), em.emit(n_extent, top)
    return Tile(wl, s, body, con, em, name, args, lines, top, rows, cols, cmask)


def epilogue(t: Tile, scope: Scope, staged: str | None) -> None:
    """The op's stores in the accumulator's layout: the tile's rows and columns are its slices. The
    `staged` output's tile goes through shared memory and a TMA copy, which runs on while the program
    computes its next tile (the copy before it must have left the buffer first)."""
    em = t.em
    scope.line(f"r = off_m + {NS}.arange(0, BLOCK_M, layout={NS}.SliceLayout(1, acc_layout))[:, None]")
    scope.line(f"rmask = r < {t.rows}")
    scope.line(f"c = off_n + {NS}.arange(0, BLOCK_N, layout={NS}.SliceLayout(0, acc_layout))[None, :]")
    if t.cmask:
        scope.line(f"cmask = c < {t.cols}")
    for st in t.body[t.body.index(t.con) + 1:]:
        if not isinstance(st, Store):
            continue
        if st.tensor != staged:
            em.store(st, scope)
            continue
        v = em.emit(st.value, scope)
        scope.line("tma.store_wait(0)  # the previous tile's copy has left the buffer")
        scope.line(f"{st.tensor}_tile.store({v}.to({dtypes.TL[em.op.dtype_of(st.tensor, em.attrs)]}))")
        scope.line("fence_async_shared()")
        scope.line(f"tma.async_copy_shared_to_global({st.tensor}_desc, [off_m, off_n], {st.tensor}_tile)")
