"""Ops: typed tensors with symbolic dims, a 2-D kernel domain and a body of statements.

A kernel of the `rowwise` or `pointwise` class walks a domain of rows x cols. Each row is independent;
`rowwise` ops may reduce along the columns of a row (Reduce statements, giving one value per row), and
`pointwise` ops may not. Statements run in order: Let names a value, Reduce names a per-row reduction,
Store writes an output element. In a `contraction` body, the statements before the Contract are a row
pass: Reduces along k and Lets of them, evaluated once per row before the k loop, which the
prologues may refer to (a fused RMSNorm's inverse root). Backends lower this one description to
Triton and TVM.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Union

from flashgen.ir import expr as E
from flashgen.kernel_classes import kernel_class

if TYPE_CHECKING:
    import torch

# Dtype placeholders that a workload binds from its attrs: the activation dtype and a quantized output's.
DTYPE, OUT_DTYPE = "$dtype", "$out_dtype"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[E.Expr, ...]
    dtype: str  # a concrete dtype name, DTYPE or OUT_DTYPE
    touched: E.Expr | None = None  # elements a kernel reads, when less than the shape (gathered tables)
    when: tuple[tuple[str, tuple[str, ...]], ...] = ()  # present only where each attr has one of these values
    written: bool = False  # an input the kernel updates in place (a KV cache): Stores may target it

    def present(self, attrs: Mapping[str, str]) -> bool:
        return all(attrs.get(a) in values for a, values in self.when)


@dataclass(frozen=True)
class Let:
    name: str
    value: E.Expr


@dataclass(frozen=True)
class Reduce:
    name: str
    kind: str  # one of expr.REDUCE
    value: E.Expr

    def __post_init__(self) -> None:
        assert self.kind in E.REDUCE, self.kind


@dataclass(frozen=True)
class Store:
    """Write `value` (cast to the tensor's dtype) where the domain, and `mask` if given, hold. With
    `combine="add"` the value is added to the element instead (atomically: rows of several programs
    may meet in one element, as a token's k expert outputs do)."""
    tensor: str
    indices: tuple[E.Expr, ...]
    value: E.Expr
    mask: E.Expr | None = None
    combine: str = ""  # "" (overwrite) or "add"

    def __post_init__(self) -> None:  # a constant index (an output's column j) as Load takes one
        object.__setattr__(self, "indices", tuple(E.lift(i) for i in self.indices))


@dataclass(frozen=True)
class Contract:
    """acc[r, c] = sum over k < extent of a(r, k) * b(c, k): the contraction class's one reduction.

    `a` and `b` are prologues over the axes (r, k) and (c, k) (loads, unpacking, dequantization);
    both are cast to `operand` (a dtype name or placeholder) for the matrix instruction, and the sum
    accumulates in `acc` ("fp32" or "int32"). Later statements (the epilogue) read it as Ref(name).
    """
    name: str
    a: E.Expr
    b: E.Expr
    extent: E.Expr
    operand: str
    acc: str = "fp32"

    def operand_dtype(self, attrs: Attrs) -> str:
        """The operands' dtype for a workload's attrs (a placeholder "$attr" names the attr that gives it)."""
        return attrs[self.operand[1:]] if self.operand.startswith("$") else self.operand


@dataclass(frozen=True)
class Attend:
    """Online-softmax attention, the attention class's one statement, FlexAttention-style: `score` is
    the logit of a query and a key as an expression of Ref("s") (the scaled dot product) and the axes
    Index("h") (query head), Index("qpos"), Index("kpos") (positions); `mask` says which keys a query
    sees. Causal, sliding-window, soft-cap and ALiBi variants are expressions, not kernels."""
    score: E.Expr
    mask: E.Expr
    kind: str = "decode"  # "decode": one query per sequence, paged cache; "prefill": packed sequences


Stmt = Union[Let, Reduce, Store, Contract, Attend]
Attrs = Mapping[str, str]
Reference = Callable[[Mapping[str, "torch.Tensor"], Mapping[str, float], Mapping[str, int], Attrs], dict]
InputMaker = Callable[[Mapping[str, int], Attrs, "torch.Generator"], dict]


@dataclass(frozen=True)
class Op:
    """One operator, described once; `reference` computes it in float64 with torch."""
    name: str
    kclass: str
    doc: str
    dims: tuple[str, ...]
    row_dims: tuple[str, ...]  # dims that may change at run time (token count): never baked in
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    domain: tuple[E.Expr, E.Expr]  # (rows, cols)
    build: Callable[[Attrs], tuple[Stmt, ...]]  # the body, for bound attrs (dtype, out_dtype, style)
    reference: Reference
    make_inputs: InputMaker
    # Workload attributes and their allowed values, the first being the default.
    attrs: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: {"dtype": ("bf16", "fp16", "fp32")})
    params: Mapping[str, float] = field(default_factory=dict)
    check_dims: Callable[[Mapping[str, int], Attrs], str | None] = lambda dims, attrs: None
    # row dims that size a buffer (a paged cache's blocks, its tables' width), not the work: the work
    # of a decode attention is B x L whatever the cache holds, so dispatch's distance to a tuned bucket
    # leaves them out (a record tuned at the same context in a larger cache is the nearer)
    capacity_dims: tuple[str, ...] = ()
    # Where a workload has no tuning records, those of its plain form serve its dispatch: the same
    # dims and weights, this op's `plain` op (a fused variant's base; "" for itself) with the attrs of
    # fused work (`fused_attrs`, such as epilogues) at their first values.
    plain: str = ""
    fused_attrs: tuple[str, ...] = ()
    # A contraction with a weight prologue: (the pointwise op that writes its weight dequantized, the
    # contraction op that runs on that weight), for schedules that dequantize first (`dequant_first`).
    dequant: tuple[str, str] = ()
    # Dims an attr's value sets (dim -> attr): a count the body unrolls (top-k's k) is an attr, since
    # `build` sees only attrs, yet tensor shapes need it as a dim; the workload binds it from the attr.
    attr_dims: Mapping[str, str] = field(default_factory=dict)

    def plain_form(self, attrs: Attrs) -> tuple[str, dict[str, str]]:
        """The op name and attrs whose records serve a workload of these attrs that has none."""
        return self.plain or self.name, {**attrs, **{a: self.attrs[a][0] for a in self.fused_attrs}}

    def body(self, attrs: Attrs) -> tuple[Stmt, ...]:
        stmts = self.build(attrs)
        if not kernel_class(self.kclass).reduces and any(isinstance(s, Reduce) for s in stmts):
            raise ValueError(f"{self.name}: a {self.kclass} op cannot reduce")
        return stmts

    def inputs_for(self, attrs: Attrs) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.inputs if t.present(attrs))

    def outputs_for(self, attrs: Attrs) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.outputs if t.present(attrs))

    @property
    def tensors(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.inputs + self.outputs}

    def dtype_of(self, tensor: str, attrs: Attrs) -> str:
        """Concrete dtype of a tensor once the workload binds the placeholders ("same" = the dtype's)."""
        dt = self.tensors[tensor].dtype
        if not dt.startswith("$"):
            return dt
        value = attrs[dt[1:]]
        return attrs["dtype"] if value == "same" else value


def eval_int(e: E.Expr, dims: Mapping[str, int]) -> int:
    """Evaluate a dims-only expression (a tensor shape or a domain extent)."""
    if isinstance(e, E.Dim):
        return int(dims[e.name])
    if isinstance(e, E.Const):
        return int(e.value)
    if isinstance(e, E.Binary):
        a, b = eval_int(e.a, dims), eval_int(e.b, dims)
        return {"add": a + b, "sub": a - b, "mul": a * b, "floordiv": a // b, "mod": a % b,
                "max": max(a, b), "min": min(a, b)}[e.op]
    raise ValueError(f"not a dims-only expression: {e}")


def is_index(e: E.Expr, op: Op) -> bool:
    """True for integer (index) expressions; everything else computes in fp32."""
    if isinstance(e, (E.Dim, E.Index)):
        return True
    if isinstance(e, E.Const):
        return e.is_int
    if isinstance(e, E.Load):
        return op.tensors[e.tensor].dtype in ("int32", "int64")
    if isinstance(e, E.Binary) and e.op in ("floordiv", "mod", "shr", "and"):
        return True
    if isinstance(e, E.Binary) and e.op in ("add", "sub", "mul", "max", "min"):
        return is_index(e.a, op) and is_index(e.b, op)
    return False


def depends_on_cols(e: E.Expr, lets: Mapping[str, E.Expr]) -> bool:
    """Whether a value varies along the columns of a row (a vector) or is one value per row."""
    for n in E.walk(e):
        if isinstance(n, E.Index) and n.axis == "c":
            return True
        if isinstance(n, E.Ref) and n.name in lets and depends_on_cols(lets[n.name], lets):
            return True
    return False


def refs(e: E.Expr) -> set[str]:
    return {n.name for n in E.walk(e) if isinstance(n, E.Ref)}
