"""What every part of a contraction kernel's generator reads: one tile's IR, schedule and scopes."""
from __future__ import annotations

from dataclasses import dataclass, field

from flashgen.ir import expr as E
from flashgen.ir.op import Contract
from flashgen.targets.triton.emit import Emitter, Scope
from flashgen.workload import Schedule

ACC = {"fp32": "tl.float32", "int32": "tl.int32"}


@dataclass
class Tile:
    """One output tile's code generation state. `top` is the scope around the k loop, `body` the
    loop's body (its axes: columns, the B tile's k, k0); `b_expr` the weight prologue made
    tile-shaped, whose `unpacked` int4 words and `grouped` scale rows a k step loads first
    (flashgen/ir/prologue.py); `affine` the int4 codes' (words, zero, scale) where the k step holds
    whole blocks of them, and `per_segment` the runs of 16 k sharing a zero point and scale."""
    em: Emitter
    con: Contract
    lets: dict[str, E.Expr]
    schedule: Schedule
    top: Scope
    body: Scope
    kmask: bool
    acc: str
    operand: str
    b_expr: E.Expr
    affine: tuple | None
    per_segment: int
    row_step: int
    unpacked: dict[E.Load, str] = field(default_factory=dict)
    grouped: dict[E.Load, str] = field(default_factory=dict)
    helpers: dict[str, str] = field(default_factory=dict)  # @triton.jit functions the kernel calls, by name

    def helper(self, name: str, source: str) -> str:
        """Define a module-level @triton.jit function once (its source: the `def` and body) and
        return its name, for the kernel to call."""
        self.helpers.setdefault(name, source)
        return name

    def open_transposed(self, acc_dtype: str) -> str | None:
        """Open a transposed tile's k loop (acc^T [block_n, block_m] = W x^T, the weight the matrix
        instruction's register operand): its row and column indices and masks, the `acc_dtype`
        accumulator and the loop header; the column mask's name where columns have a tail, else None."""
        em, top = self.em, self.top
        rows, cols = em.emit(em.op.domain[0], top), em.emit(em.op.domain[1], top)
        cmask = "cmask_t" if top.axes["c"][1] else None
        top.line("r_t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]")
        top.line(f"rmask_t = r_t < {rows}")
        top.line("c_t = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]")
        if cmask:
            top.line(f"cmask_t = c_t < {cols}")
        top.line(f"{self.acc}_t = tl.zeros([BLOCK_N, BLOCK_M], dtype={acc_dtype})")
        top.line("for k0 in range(k_lo, k_hi, BLOCK_K):")
        return cmask

    def at_k(self, var: str, start: str, cmask: str | None, k_extent: str) -> Scope:
        """A scope of the transposed tile's columns at the one k `var` = `start` (a group's or segment's
        first k), masked past K where the tile has a k tail: where a per-group scale or zero loads."""
        self.body.line(f"{var} = {start}")
        mask = None
        if self.kmask:
            self.body.line(f"{var}m = {var} < {k_extent}")
            mask = f"{var}m"
        return self.body.child(axes={"c": ("c_t", cmask), "k": (var, mask)}, fresh=True)
