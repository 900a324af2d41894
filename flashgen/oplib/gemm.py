"""Contraction ops: y[M, N] = epilogue(sum_k prologue_A(x[M, K]) * prologue_B(w[N, K])).

Weights are in nn.Linear layout [N, K]. Prologues unpack and dequantize; epilogues apply per-token and
per-channel scales. Per-channel weight scales multiply the accumulator once (exact, and K times fewer
multiplies); group scales must apply inside the k loop.
"""
from __future__ import annotations

import torch

from flashgen.ir import dtypes
from flashgen.ir.expr import Const, Dim, Index, Load, Ref
from flashgen.ir.op import DTYPE, Contract, Op, Store, TensorSpec
from flashgen.oplib._common import M, N, c, f64, r, randn
from flashgen.quant import pack_int4, quantize_rtn

K = Dim("K")
k = Index("k")
HALF = ("bf16", "fp16")


def _out(y: Ref) -> tuple:
    return (Store("y", (r, c), y),)


def _xw_inputs(d, a, g, w_dtype: str | None = None) -> dict:
    x = randn((d["M"], d["K"]), a["dtype"], g)
    w = torch.randn((d["N"], d["K"]), generator=g) / d["K"] ** 0.5
    return {"x": x, "w": w.to(dtypes.TORCH[w_dtype or a["dtype"]])}


GEMM = Op(
    name="gemm", kclass="contraction", doc="y = x @ w.T (fp16/bf16, fp32 accumulation)",
    dims=("M", "N", "K"), row_dims=("M",),
    inputs=(TensorSpec("x", (M, K), DTYPE), TensorSpec("w", (N, K), DTYPE)),
    outputs=(TensorSpec("y", (M, N), DTYPE),), domain=(M, N), attrs={"dtype": HALF},
    build=lambda a: (Contract("acc", Load("x", (r, k)), Load("w", (c, k)), K, DTYPE), *_out(Ref("acc"))),
    reference=lambda t, p, d, a: {"y": f64(t["x"]) @ f64(t["w"]).T},
    make_inputs=lambda d, a, g: _xw_inputs(d, a, g),
)


def _w8a16_inputs(d, a, g) -> dict:
    x = randn((d["M"], d["K"]), a["dtype"], g)
    qw = quantize_rtn(torch.randn((d["N"], d["K"]), generator=g), bits=8)
    return {"x": x, "w": qw.codes, "w_scale": qw.scales[:, 0].contiguous()}


W8A16 = Op(
    name="gemm_w8a16", kclass="contraction",
    doc="y = x @ (w_int8 * w_scale[n]).T: int8 weights, per-channel fp32 scales, fp16/bf16 activations",
    dims=("M", "N", "K"), row_dims=("M",),
    inputs=(TensorSpec("x", (M, K), DTYPE), TensorSpec("w", (N, K), "int8"), TensorSpec("w_scale", (N,), "fp32")),
    outputs=(TensorSpec("y", (M, N), DTYPE),), domain=(M, N), attrs={"dtype": HALF},
    build=lambda a: (Contract("acc", Load("x", (r, k)), Load("w", (c, k)), K, DTYPE),
                     *_out(Ref("acc") * Load("w_scale", (c,)))),
    reference=lambda t, p, d, a: {"y": f64(t["x"]) @ (f64(t["w"]) * f64(t["w_scale"])[:, None]).T},
    make_inputs=_w8a16_inputs,
)


def _w4_build(a) -> tuple:
    code = (Load("w_packed", (c, k // 8)) >> ((k % 8) * 4)) & 15
    zero = Const(8) if a["zp"] == "sym" else Load("zeros", (c, k // Dim("G")))
    if a["group"] == "channel":
        return (Contract("acc", Load("x", (r, k)), code - zero, K, DTYPE),
                *_out(Ref("acc") * Load("scales", (c, 0))))
    return (Contract("acc", Load("x", (r, k)), (code - zero) * Load("scales", (c, k // Dim("G"))), K, DTYPE),
            *_out(Ref("acc")))


def _w4_inputs(d, a, g) -> dict:
    x = randn((d["M"], d["K"]), a["dtype"], g)
    qw = quantize_rtn(torch.randn((d["N"], d["K"]), generator=g), bits=4, group=d["G"],
                      symmetric=a["zp"] == "sym")
    t = {"x": x, "w_packed": pack_int4(qw.codes), "scales": qw.scales.to(dtypes.TORCH[a["dtype"]])}
    zeros = qw.zeros if qw.zeros is not None else torch.full_like(qw.codes[:, :: d["G"]], 8)
    t["zeros"] = zeros.to(torch.int8)  # read only with zp=asym
    return t


def _w4_reference(t, p, d, a) -> dict:
    codes = torch.stack([(t["w_packed"].to(torch.int64) >> (4 * j)) & 15 for j in range(8)], -1)
    codes = codes.reshape(d["N"], d["K"]).to(torch.float64)
    zeros = f64(t["zeros"]) if a["zp"] == "asym" else torch.full_like(f64(t["scales"]), 8.0)
    w = (codes - zeros.repeat_interleave(d["G"], 1)) * f64(t["scales"]).repeat_interleave(d["G"], 1)
    return {"y": f64(t["x"]) @ w.T}


def _w4_dims(d, a) -> str | None:
    if a["group"] == "channel" and d["G"] != d["K"]:
        return f"per-channel scales need G=K (got G={d['G']}, K={d['K']})"
    if d["K"] % 8:
        return f"K={d['K']} must be a multiple of 8 (eight 4-bit codes per int32)"
    if d["K"] % d["G"]:
        return f"K={d['K']} must be a multiple of the group size G={d['G']}"
    return None


W4A16 = Op(
    name="gemm_w4a16", kclass="contraction",
    doc="y = x @ dequant(w_int4).T: 4-bit weights packed 8 per int32, group or per-channel scales, "
        "symmetric or with zero points",
    dims=("M", "N", "K", "G"), row_dims=("M",),
    inputs=(TensorSpec("x", (M, K), DTYPE), TensorSpec("w_packed", (N, K // 8), "int32"),
            TensorSpec("scales", (N, K // Dim("G")), DTYPE), TensorSpec("zeros", (N, K // Dim("G")), "int8")),
    outputs=(TensorSpec("y", (M, N), DTYPE),), domain=(M, N),
    # group: scales per G consecutive k (applied in the k loop), or channel: G=K, applied to the sum.
    attrs={"dtype": HALF, "zp": ("sym", "asym"), "group": ("group", "channel")},
    build=_w4_build, reference=_w4_reference, make_inputs=_w4_inputs, check_dims=_w4_dims,
)


def _scaled_inputs(d, a, g, qdtype: str) -> dict:
    from flashgen.oplib._common import quantize_ref
    xf = torch.randn((d["M"], d["K"]), generator=g, dtype=torch.float64)
    wf = torch.randn((d["N"], d["K"]), generator=g, dtype=torch.float64)
    xq, xs = quantize_ref(xf, qdtype)
    wq, ws = quantize_ref(wf, qdtype)
    t = dtypes.TORCH[qdtype]
    return {"x": xq.to(t), "x_scale": xs.float(), "w": wq.to(t), "w_scale": ws.float()}


def _scaled_reference(t, p, d, a) -> dict:
    return {"y": (f64(t["x"]) * f64(t["x_scale"])[:, None]) @ (f64(t["w"]) * f64(t["w_scale"])[:, None]).T}


def _scaled(name: str, qdtype: str, acc: str, doc: str) -> Op:
    return Op(
        name=name, kclass="contraction", doc=doc, dims=("M", "N", "K"), row_dims=("M",),
        inputs=(TensorSpec("x", (M, K), qdtype), TensorSpec("x_scale", (M,), "fp32"),
                TensorSpec("w", (N, K), qdtype), TensorSpec("w_scale", (N,), "fp32")),
        outputs=(TensorSpec("y", (M, N), DTYPE),), domain=(M, N), attrs={"dtype": HALF},
        build=lambda a: (Contract("acc", Load("x", (r, k)), Load("w", (c, k)), K, qdtype, acc),
                         *_out(Ref("acc") * Load("x_scale", (r,)) * Load("w_scale", (c,)))),
        reference=_scaled_reference, make_inputs=lambda d, a, g: _scaled_inputs(d, a, g, qdtype),
    )


W8A8 = _scaled("gemm_w8a8", "int8", "int32",
               "y = (x_int8 @ w_int8.T) * x_scale[m] * w_scale[n]: int8 tensor cores, int32 accumulation, "
               "per-token and per-channel scales fused")
FP8 = _scaled("gemm_fp8", "fp8e4m3", "fp32",
              "y = (x_fp8 @ w_fp8.T) * x_scale[m] * w_scale[n]: e4m3 operands, fp32 accumulation (sm_90)")

OPS = (GEMM, W8A16, W4A16, W8A8, FP8)
