"""Expression trees of the operator IR.

Expressions are immutable and hash by structure, so backends get common-subexpression elimination for
free by keying emitted values on the node. Arithmetic is written with Python operators; everything
floating computes in fp32 and is cast only where a Store writes its tensor's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

UNARY = ("neg", "exp", "log", "sqrt", "rsqrt", "abs", "sigmoid", "tanh", "erf", "rint", "cos", "sin")
BINARY = ("add", "sub", "mul", "div", "max", "min", "floordiv", "mod", "lt", "le", "gt", "ge", "eq",
          "shr", "and")  # shr/and: bit fields of packed integer tensors (int4 weights)
REDUCE = ("sum", "max", "min")

Operand = Union["Expr", int, float]


class Expr:
    """Base of all expression nodes: operator overloading builds Binary/Unary nodes."""

    def __add__(self, o: Operand) -> Expr: return Binary("add", self, lift(o))
    def __radd__(self, o: Operand) -> Expr: return Binary("add", lift(o), self)
    def __sub__(self, o: Operand) -> Expr: return Binary("sub", self, lift(o))
    def __rsub__(self, o: Operand) -> Expr: return Binary("sub", lift(o), self)
    def __mul__(self, o: Operand) -> Expr: return Binary("mul", self, lift(o))
    def __rmul__(self, o: Operand) -> Expr: return Binary("mul", lift(o), self)
    def __truediv__(self, o: Operand) -> Expr: return Binary("div", self, lift(o))
    def __rtruediv__(self, o: Operand) -> Expr: return Binary("div", lift(o), self)
    def __floordiv__(self, o: Operand) -> Expr: return Binary("floordiv", self, lift(o))
    def __mod__(self, o: Operand) -> Expr: return Binary("mod", self, lift(o))
    def __rshift__(self, o: Operand) -> Expr: return Binary("shr", self, lift(o))
    def __and__(self, o: Operand) -> Expr: return Binary("and", self, lift(o))
    def __neg__(self) -> Expr: return Unary("neg", self)
    def __lt__(self, o: Operand) -> Expr: return Binary("lt", self, lift(o))
    def __ge__(self, o: Operand) -> Expr: return Binary("ge", self, lift(o))


@dataclass(frozen=True, eq=True)
class Const(Expr):
    value: float | int

    @property
    def is_int(self) -> bool:
        return isinstance(self.value, int)


@dataclass(frozen=True, eq=True)
class Dim(Expr):
    """A symbolic dimension (bound by the workload): an integer in index math, a float elsewhere."""
    name: str


@dataclass(frozen=True, eq=True)
class Param(Expr):
    """A runtime fp32 scalar argument (eps, temperature): not part of the workload key."""
    name: str


@dataclass(frozen=True, eq=True)
class Index(Expr):
    """The kernel domain's row (`r`) or column (`c`) coordinate."""
    axis: str


@dataclass(frozen=True, eq=True)
class Load(Expr):
    """Element of an input tensor at per-dimension indices (last dimension contiguous).

    Where `mask` is given and false the element is not read and the value is 0.
    """
    tensor: str
    indices: tuple[Expr, ...]
    mask: Expr | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(lift(i) for i in self.indices))


@dataclass(frozen=True, eq=True)
class Unary(Expr):
    fn: str
    x: Expr

    def __post_init__(self) -> None:
        assert self.fn in UNARY, self.fn


@dataclass(frozen=True, eq=True)
class Binary(Expr):
    op: str
    a: Expr
    b: Expr

    def __post_init__(self) -> None:
        assert self.op in BINARY, self.op


@dataclass(frozen=True, eq=True)
class Where(Expr):
    cond: Expr
    a: Expr
    b: Expr


@dataclass(frozen=True, eq=True)
class Ref(Expr):
    """A value named by an earlier Let or Reduce statement."""
    name: str


def lift(v: Operand) -> Expr:
    if isinstance(v, Expr):
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TypeError(f"cannot use {v!r} in an expression")
    return Const(v)


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Load):
        return e.indices + ((e.mask,) if e.mask is not None else ())
    if isinstance(e, Unary):
        return (e.x,)
    if isinstance(e, Binary):
        return (e.a, e.b)
    if isinstance(e, Where):
        return (e.cond, e.a, e.b)
    return ()


def transform(e: Expr, f) -> Expr:
    """Rebuild `e` bottom-up, replacing each node n by f(n) (f returns n itself to keep it)."""
    if isinstance(e, Load):
        n: Expr = Load(e.tensor, tuple(transform(i, f) for i in e.indices),
                       transform(e.mask, f) if e.mask is not None else None)
    elif isinstance(e, Unary):
        n = Unary(e.fn, transform(e.x, f))
    elif isinstance(e, Binary):
        n = Binary(e.op, transform(e.a, f), transform(e.b, f))
    elif isinstance(e, Where):
        n = Where(transform(e.cond, f), transform(e.a, f), transform(e.b, f))
    else:
        n = e
    return f(n)


def walk(e: Expr):
    """Yield every node of the tree, children first."""
    for ch in children(e):
        yield from walk(ch)
    yield e


# Short constructors used by the op library.
def exp(x: Operand) -> Expr: return Unary("exp", lift(x))
def log(x: Operand) -> Expr: return Unary("log", lift(x))
def sqrt(x: Operand) -> Expr: return Unary("sqrt", lift(x))
def rsqrt(x: Operand) -> Expr: return Unary("rsqrt", lift(x))
def absolute(x: Operand) -> Expr: return Unary("abs", lift(x))
def sigmoid(x: Operand) -> Expr: return Unary("sigmoid", lift(x))
def tanh(x: Operand) -> Expr: return Unary("tanh", lift(x))
def erf(x: Operand) -> Expr: return Unary("erf", lift(x))
def rint(x: Operand) -> Expr: return Unary("rint", lift(x))
def maximum(a: Operand, b: Operand) -> Expr: return Binary("max", lift(a), lift(b))
def minimum(a: Operand, b: Operand) -> Expr: return Binary("min", lift(a), lift(b))
def where(c: Expr, a: Operand, b: Operand) -> Expr: return Where(c, lift(a), lift(b))
def clamp(x: Operand, lo: Operand, hi: Operand) -> Expr: return minimum(maximum(x, lo), hi)
