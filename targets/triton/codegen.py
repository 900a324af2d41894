"""Triton code generation: `generate` builds any kernel class this backend has a generator for
(flashgen/kernel_classes.py names them: the row classes' `generate_rows` here, contraction in
`contraction.py`, attention in `attention.py`).

The generated module is plain, readable Triton: one program per tile of `block_r` rows x `block_c`
columns of the op's domain; every float computes in fp32 and is cast where it is stored. A rowwise op
whose row fits one tile reads it once; a longer row is walked in tiles, one pass per reduction and a
last pass for the stores that need every reduction, each store placed in the earliest pass that can
make it (the row plan, flashgen/ir/row_plan.py, which the TVM backend walks too). A pointwise op (its class `tiles_cols`) tiles its columns across programs too. Dims other
than the row count are compile-time constants, so tails and masks fold away when a tile divides the row.
"""
from __future__ import annotations

from typing import Mapping

from flashgen.ir import expr as E
from flashgen.ir.op import Let, Reduce, Stmt, Store
from flashgen.ir.row_plan import RowLevel, row_plan
from flashgen.kernel_classes import generator, kernel_class, schedule_backend
from flashgen.targets.triton.emit import (COMBINE, IDENTITY, REDUCE_FN, Emitter, KernelSource, Scope, grid_dependency, kernel_args,
                                          module_header)
from flashgen.workload import Schedule, Workload, domain


class _RowGen:
    def __init__(self, wl: Workload, schedule: Schedule):
        self.wl, self.op, self.s = wl, wl.op, schedule
        self.body: tuple[Stmt, ...] = self.op.body(wl.attr)
        self.lets = {st.name: st.value for st in self.body if isinstance(st, Let)}
        self.rows, self.cols = domain(wl)
        self.tiles_cols = kernel_class(self.op.kclass).tiles_cols
        self.looped = not self.tiles_cols and schedule["block_c"] < self.cols
        self.rmask = "rmask" if schedule["block_r"] > 1 else None
        self.cmask = "cmask" if self.cols % schedule["block_c"] != 0 else None
        self.em = Emitter(self.op, wl.attr, self.lets)

    def reduce_tile(self, st: Reduce, scope: Scope) -> str:
        v = self.em.emit(st.value, scope)
        return f"tl.where(cmask, {v}, {IDENTITY[st.kind]})" if self.cmask else v

    def column_setup(self, scope: Scope, start: str) -> None:
        scope.line(f"c = {start}tl.arange(0, BLOCK_C)[None, :]")
        if self.cmask:
            scope.line(f"cmask = c < {self.em.emit(self.op.domain[1], scope)}")

    def single_tile(self, scope: Scope) -> None:
        start = "pid_c * BLOCK_C + " if self.tiles_cols else ""
        self.column_setup(scope, start)
        for st in self.body:
            if isinstance(st, Reduce):
                fn = REDUCE_FN[st.kind]
                self.em.named[st.name] = self.em.temp(scope, f"{fn}({self.reduce_tile(st, scope)}, axis=1)[:, None]",
                                                      st.name)
            elif isinstance(st, Store):
                self.em.store(st, scope)

    def row_level(self, step: RowLevel, scope: Scope) -> None:
        """Row-level values and stores, at row scope between the tile loops."""
        for name in step.lets:
            self.em.emit(E.Ref(name), scope)
        for st in step.stores:
            self.em.store(st, scope)

    def multi_tile(self, scope: Scope) -> None:
        """The row walked in tiles: one loop per pass of the row plan (flashgen/ir/row_plan.py)."""
        plan = row_plan(self.body)
        self.row_level(plan.before, scope)
        for p in plan.passes:
            red, acc = p.reduce, None
            if red is not None:
                acc = self.em.temp(scope, f"tl.full([BLOCK_R, BLOCK_C], {IDENTITY[red.kind]}, tl.float32)")
            scope.line(f"for c0 in range(0, {self.em.emit(self.op.domain[1], scope)}, BLOCK_C):")
            inner = scope.child(scope.indent + "    ")
            self.column_setup(inner, "c0 + ")
            for st in p.stores:
                self.em.store(st, inner)
            if red is not None:
                v = self.reduce_tile(red, inner)
                inner.line(f"{acc} = {COMBINE[red.kind].format(acc, v)}")
                self.em.named[red.name] = self.em.temp(scope, f"{REDUCE_FN[red.kind]}({acc}, axis=1)[:, None]", red.name)
            self.row_level(p.after, scope)

    def generate(self) -> KernelSource:
        name = f"{self.op.name}_kernel"
        args = kernel_args(self.wl, {"BLOCK_R": self.s["block_r"], "BLOCK_C": self.s["block_c"]})
        lines = module_header(self.wl, self.s, name, args)
        scope = Scope(lines, "    ", {"r": ("r", self.rmask), "c": ("c", self.cmask)})
        grid_dependency(scope)
        scope.line("pid_r = tl.program_id(0)")
        if self.tiles_cols:
            scope.line("pid_c = tl.program_id(1)")
        scope.line("r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]")
        if self.rmask:
            scope.line(f"rmask = r < {self.em.emit(self.op.domain[0], scope)}")
        if self.looped:
            self.multi_tile(scope)
        else:
            self.single_tile(scope)
        return KernelSource(name, self.em.finish(lines), args, (self.s["block_r"], self.s["block_c"]),
                            tile_cols=self.tiles_cols)


def generate_rows(wl: Workload, schedule: Schedule) -> KernelSource:
    """The rowwise and pointwise classes' generator."""
    return _RowGen(wl, schedule).generate()


def generate(wl: Workload, schedule: Schedule) -> KernelSource:
    """The source of `wl` under `schedule`, by its class's generator: Triton's, or Gluon's where the
    schedule's `backend` knob asks for it (targets/gluon)."""
    return generator(wl.op.kclass, schedule_backend(schedule))(wl, schedule)


def grid(ks: KernelSource, wl: Workload, rows: int | None = None, sm_count: int = 0,
         dims: Mapping[str, int] | None = None) -> tuple[int, int, int]:
    """Programs to launch for `rows` rows of the domain (the workload's own row count by default) and the
    call's run-time `dims` (the workload's by default); a persistent kernel gets at most `persistent`
    programs per SM of the device."""
    r, c = domain(wl)
    rows = r if rows is None else rows
    tr, tc = ks.tiles
    nr, nc = -(-rows // tr), (-(-c // tc) if ks.tile_cols else 1)
    d = wl.dim if dims is None else dims
    if ks.seq_tiles:  # (each tile holds a row at least: never more tiles than rows)
        nr = min(nr + d[ks.seq_tiles], rows)
    if ks.slots:
        nr *= min(d[ks.slots], rows)
    if ks.persistent and sm_count:
        return (min(nr * nc, ks.persistent * sm_count), 1, ks.grid_z)
    return (nr * nc, 1, ks.grid_z) if ks.flat else (nr, nc, ks.grid_z)
