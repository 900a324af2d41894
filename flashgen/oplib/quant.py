"""Dynamic per-token quantization: dynamic_quant and the fused rmsnorm_quant.

Each row gets one fp32 scale = absmax / qmax (qmax 127 for int8, 448 for fp8 e4m3); values are
x / scale, rounded half-to-even for int8, and clamped to the output type's range.
"""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.ir.expr import Load, Ref, absolute, clamp, maximum, rint
from flashgen.ir.op import DTYPE, OUT_DTYPE, Let, Op, Reduce, Store, TensorSpec
from flashgen.oplib._common import FLOAT_DTYPES, M, N, c, f64, quantize_ref, r, randn
from flashgen.oplib.norm import _rms, rmsnorm_stmts

ATTRS = {"dtype": FLOAT_DTYPES, "out_dtype": ("int8", "fp8e4m3")}


def quant_stmts(y: Ref, out_dtype: str) -> tuple:
    qmax = dtypes.QMAX[out_dtype]
    q = clamp(y / Ref("scale"), -qmax, qmax)
    return (Reduce("amax", "max", absolute(y)),
            Let("scale", maximum(Ref("amax"), 1e-10) / qmax),
            Store("q", (r, c), rint(q) if out_dtype == "int8" else q),
            Store("scale", (r,), Ref("scale")))


def _inputs(d, a, g, weight: bool) -> dict:
    t = {"x": randn((d["M"], d["N"]), a["dtype"], g)}
    if weight:
        t["w"] = randn((d["N"],), a["dtype"], g, 1.0, 0.2)
    return t


def _quant_out(y, a) -> dict:
    q, scale = quantize_ref(y, a["out_dtype"])
    return {"q": q, "scale": scale}


OUTPUTS = (TensorSpec("q", (M, N), OUT_DTYPE), TensorSpec("scale", (M,), "fp32"))

DYNAMIC_QUANT = Op(
    name="dynamic_quant", kclass="rowwise",
    doc="per-token symmetric quantization to int8 (or fp8 e4m3) with one fp32 scale per row",
    dims=("M", "N"), row_dims=("M",),
    inputs=(TensorSpec("x", (M, N), DTYPE),), outputs=OUTPUTS, domain=(M, N), attrs=ATTRS,
    build=lambda a: (Let("x", Load("x", (r, c))), *quant_stmts(Ref("x"), a["out_dtype"])),
    reference=lambda t, p, d, a: _quant_out(f64(t["x"]), a),
    make_inputs=lambda d, a, g: _inputs(d, a, g, weight=False),
)

RMSNORM_QUANT = Op(
    name="rmsnorm_quant", kclass="rowwise",
    doc="rmsnorm followed by per-token quantization, fused: the normalised row never leaves the chip",
    dims=("M", "N"), row_dims=("M",),
    inputs=(TensorSpec("x", (M, N), DTYPE), TensorSpec("w", (N,), DTYPE)), outputs=OUTPUTS,
    domain=(M, N), attrs=ATTRS, params={"eps": 1e-6},
    build=lambda a: (Let("x", Load("x", (r, c))), *rmsnorm_stmts(Ref("x")),
                     *quant_stmts(Ref("y"), a["out_dtype"])),
    reference=lambda t, p, d, a: _quant_out(_rms(f64(t["x"]), f64(t["w"]), p["eps"]), a),
    make_inputs=lambda d, a, g: _inputs(d, a, g, weight=True),
)

OPS = (DYNAMIC_QUANT, RMSNORM_QUANT)
