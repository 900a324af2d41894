"""The op library: every operator flashgen generates, each described once in the IR."""
from __future__ import annotations

from flashgen.errors import FlashgenError
from flashgen.ir.op import Op
from flashgen.oplib import activation, attention, gemm, moe, norm, quant, rope

OPS: dict[str, Op] = {op.name: op for mod in (norm, quant, activation, moe, rope, gemm, attention) for op in mod.OPS}


def get_op(name: str) -> Op:
    try:
        return OPS[name]
    except KeyError:
        raise FlashgenError(f"unknown op '{name}'; valid ops: {', '.join(sorted(OPS))}") from None
