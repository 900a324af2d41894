"""Activations and softmax: silu_mul (SwiGLU gate), softmax over the last axis."""
from __future__ import annotations

from flashgen.lazy import lazy

torch = lazy("torch")

from flashgen.ir.expr import Load, Param, Ref, exp, sigmoid
from flashgen.ir.op import DTYPE, Let, Op, Reduce, Store, TensorSpec
from flashgen.oplib._common import M, N, c, f64, r, randn

SILU_MUL = Op(
    name="silu_mul", kclass="pointwise",
    doc="y = silu(x[:, :N]) * x[:, N:] (gate and up halves of a fused SwiGLU projection)",
    dims=("M", "N"), row_dims=("M",),
    inputs=(TensorSpec("x", (M, 2 * N), DTYPE),),
    outputs=(TensorSpec("y", (M, N), DTYPE),),
    domain=(M, N),
    build=lambda a: (Let("g", Load("x", (r, c))),
                     Store("y", (r, c), Ref("g") * sigmoid(Ref("g")) * Load("x", (r, c + N)))),
    reference=lambda t, p, d, a: _silu_mul(f64(t["x"]), d["N"]),
    make_inputs=lambda d, a, g: {"x": randn((d["M"], 2 * d["N"]), a["dtype"], g, 0.0, 2.0)},
)


def _silu_mul(x: torch.Tensor, n: int) -> dict:
    g, u = x[:, :n], x[:, n:]
    return {"y": g * torch.sigmoid(g) * u}


SOFTMAX = Op(
    name="softmax", kclass="rowwise",
    doc="y = softmax(x / temperature) over the last axis (max-subtracted)",
    dims=("M", "N"), row_dims=("M",),
    inputs=(TensorSpec("x", (M, N), DTYPE),),
    outputs=(TensorSpec("y", (M, N), DTYPE),),
    domain=(M, N), params={"temperature": 1.0},
    build=lambda a: (Let("s", Load("x", (r, c)) / Param("temperature")),
                     Reduce("m", "max", Ref("s")),
                     Let("e", exp(Ref("s") - Ref("m"))),
                     Reduce("z", "sum", Ref("e")),
                     Store("y", (r, c), Ref("e") / Ref("z"))),
    reference=lambda t, p, d, a: {"y": torch.softmax(f64(t["x"]) / p["temperature"], dim=-1)},
    make_inputs=lambda d, a, g: {"x": randn((d["M"], d["N"]), a["dtype"], g, 0.0, 3.0)},
)

OPS = (SILU_MUL, SOFTMAX)
