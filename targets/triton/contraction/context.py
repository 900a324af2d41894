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
