"""Normalisations: rmsnorm, layernorm, add_rmsnorm (fused residual add)."""
from __future__ import annotations

from flashgen.ir.expr import Load, Param, Ref, rsqrt
from flashgen.ir.op import DTYPE, Let, Op, Reduce, Store, TensorSpec
from flashgen.oplib._common import M, N, c, f64, r, randn


def _rms(x, w, eps):
    return x * ((x * x).mean(-1, keepdim=True) + eps).rsqrt() * w


def rms_inverse(x, n=N) -> tuple:
    """inv = 1 / sqrt(mean(x^2) + eps) over the n values of a row, as statements (the reduction's axis
    is the kernel class's: a row's columns, or a contraction's k)."""
    return (Reduce("ss", "sum", x * x), Let("inv", rsqrt(Ref("ss") / n + Param("eps"))))


def rmsnorm_stmts(x: Ref) -> tuple:
    """y = x / sqrt(mean(x^2) + eps) * w, as statements over a value `x` already named in the body."""
    return (*rms_inverse(x), Let("y", x * Ref("inv") * Load("w", (c,))))


RMSNORM = Op(
    name="rmsnorm", kclass="rowwise",
    doc="y = x * rsqrt(mean(x^2) + eps) * w over the last axis (Llama RMSNorm)",
    dims=("M", "N"), row_dims=("M",),
    inputs=(TensorSpec("x", (M, N), DTYPE), TensorSpec("w", (N,), DTYPE)),
    outputs=(TensorSpec("y", (M, N), DTYPE),),
    domain=(M, N), params={"eps": 1e-6},
    build=lambda a: (Let("x", Load("x", (r, c))), *rmsnorm_stmts(Ref("x")),
                     Store("y", (r, c), Ref("y"))),
    reference=lambda t, p, d, a: {"y": _rms(f64(t["x"]), f64(t["w"]), p["eps"])},
    make_inputs=lambda d, a, g: {"x": randn((d["M"], d["N"]), a["dtype"], g),
                                 "w": randn((d["N"],), a["dtype"], g, 1.0, 0.2)},
)

LAYERNORM = Op(
    name="layernorm", kclass="rowwise",
    doc="y = (x - mean) * rsqrt(var + eps) * w + b over the last axis",
    dims=("M", "N"), row_dims=("M",),
    inputs=(TensorSpec("x", (M, N), DTYPE), TensorSpec("w", (N,), DTYPE), TensorSpec("b", (N,), DTYPE)),
    outputs=(TensorSpec("y", (M, N), DTYPE),),
    domain=(M, N), params={"eps": 1e-5},
    build=lambda a: (
        Let("x", Load("x", (r, c))),
        Reduce("sum", "sum", Ref("x")),
        Let("xc", Ref("x") - Ref("sum") / N),
        Reduce("ssd", "sum", Ref("xc") * Ref("xc")),
        Store("y", (r, c), Ref("xc") * rsqrt(Ref("ssd") / N + Param("eps")) * Load("w", (c,))
              + Load("b", (c,))),
    ),
    reference=lambda t, p, d, a: {"y": _layernorm(f64(t["x"]), f64(t["w"]), f64(t["b"]), p["eps"])},
    make_inputs=lambda d, a, g: {"x": randn((d["M"], d["N"]), a["dtype"], g, 0.5),
                                 "w": randn((d["N"],), a["dtype"], g, 1.0, 0.2),
                                 "b": randn((d["N"],), a["dtype"], g, 0.0, 0.2)},
)


def _layernorm(x, w, b, eps):
    xc = x - x.mean(-1, keepdim=True)
    return xc * ((xc * xc).mean(-1, keepdim=True) + eps).rsqrt() * w + b


ADD_RMSNORM = Op(
    name="add_rmsnorm", kclass="rowwise",
    doc="h = x + residual; returns rmsnorm(h) * w and h (the new residual), one pass",
    dims=("M", "N"), row_dims=("M",),
    inputs=(TensorSpec("x", (M, N), DTYPE), TensorSpec("residual", (M, N), DTYPE),
            TensorSpec("w", (N,), DTYPE)),
    outputs=(TensorSpec("y", (M, N), DTYPE), TensorSpec("residual_out", (M, N), DTYPE)),
    domain=(M, N), params={"eps": 1e-6},
    build=lambda a: (Let("h", Load("x", (r, c)) + Load("residual", (r, c))),
                     Store("residual_out", (r, c), Ref("h")),
                     *rmsnorm_stmts(Ref("h")),
                     Store("y", (r, c), Ref("y"))),
    reference=lambda t, p, d, a: _add_rmsnorm_ref(t, p),
    make_inputs=lambda d, a, g: {"x": randn((d["M"], d["N"]), a["dtype"], g),
                                 "residual": randn((d["M"], d["N"]), a["dtype"], g),
                                 "w": randn((d["N"],), a["dtype"], g, 1.0, 0.2)},
)


def _add_rmsnorm_ref(t, p):
    h = f64(t["x"]) + f64(t["residual"])
    return {"y": _rms(h, f64(t["w"]), p["eps"]), "residual_out": h}


OPS = (RMSNORM, LAYERNORM, ADD_RMSNORM)
