"""Operator IR: expressions (`expr`), ops and statements (`op`), dtype names (`dtypes`)."""
from flashgen.ir.expr import Const, Dim, Expr, Index, Load, Param, Ref
from flashgen.ir.op import DTYPE, OUT_DTYPE, Let, Op, Reduce, Store, TensorSpec

__all__ = ["Const", "Dim", "Expr", "Index", "Load", "Param", "Ref", "DTYPE", "OUT_DTYPE", "Let", "Op",
           "Reduce", "Store", "TensorSpec"]
