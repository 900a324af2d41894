"""Contraction ops: y[M, N] = epilogue(sum_k prologue_A(x[M, K]) * prologue_B(w[N, K])).

Weights are in nn.Linear layout [N, K]. Prologues unpack and dequantize; epilogues apply per-token and
per-channel scales. Per-channel weight scales multiply the accumulator once (exact, and K times fewer
multiplies); group scales must apply inside the k loop. The `rmsnorm_` and `silu_mul_` variants of
the ops with 16-bit activations normalize x (Llama's RMSNorm) or gate it (SiLU·mul of the MLP) on
the way in, fused into the linear they feed.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

from flashgen.lazy import lazy

torch = lazy("torch")

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir.expr import Const, Dim, Index, Load, Ref, clamp, erf, rint, sigmoid
from flashgen.ir.op import DTYPE, Contract, Op, Store, TensorSpec
from flashgen.oplib._common import M, N, c, f64, r, randn
from flashgen.oplib.activation import _silu_mul
from flashgen.oplib.norm import _rms, rms_inverse
from flashgen.ir.prologue import int4_code, int4_lane
from flashgen.quant import PACKS, pack_int4, packed_words, quantize_rtn, quantize_w4a8, unpack_int4

K = Dim("K")
k = Index("k")
HALF = ("bf16", "fp16")
# Epilogue attrs every GEMM op takes: y = act(acc * scales + bias) + residual, optionally quantized to
# int8 with a static per-tensor scale. Each is an IR expression, fused into the kernel's store.
EPILOGUE = {"with_bias": ("no", "yes"), "act": ("none", "silu", "gelu"), "with_residual": ("no", "yes"),
            "out": ("none", "int8")}
EPILOGUE_INPUTS = (TensorSpec("bias", (N,), DTYPE, when=(("with_bias", ("yes",)),)),
                   TensorSpec("residual", (M, N), DTYPE, when=(("with_residual", ("yes",)),)),
                   TensorSpec("out_scale", (Const(1),), "fp32", when=(("out", ("int8",)),)))
OUTPUTS = (TensorSpec("y", (M, N), DTYPE, when=(("out", ("none",)),)),
           TensorSpec("y_q", (M, N), "int8", when=(("out", ("int8",)),)))


def _out(y: E.Expr, a) -> tuple:
    """The epilogue's statements for the accumulator value `y` (already scaled)."""
    if a["with_bias"] == "yes":
        y = y + Load("bias", (c,))
    if a["act"] == "silu":
        y = y * sigmoid(y)
    elif a["act"] == "gelu":
        y = 0.5 * y * (1.0 + erf(y * 0.7071067811865476))
    if a["with_residual"] == "yes":
        y = y + Load("residual", (r, c))
    if a["out"] == "int8":
        return (Store("y_q", (r, c), rint(clamp(y / Load("out_scale", (0,)), -127.0, 127.0))),)
    return (Store("y", (r, c), y),)


def _epilogue_ref(y: torch.Tensor, t, a) -> dict:
    if a["with_bias"] == "yes":
        y = y + f64(t["bias"])
    if a["act"] == "silu":
        y = y * torch.sigmoid(y)
    elif a["act"] == "gelu":
        y = 0.5 * y * (1.0 + torch.erf(y / 2 ** 0.5))
    if a["with_residual"] == "yes":
        y = y + f64(t["residual"])
    if a["out"] == "int8":
        return {"y_q": torch.round(y / f64(t["out_scale"])[0]).clamp(-127, 127)}
    return {"y": y}


def _with_epilogue(make, base_ref):
    """Input maker adding the epilogue's tensors; the output scale fits the data it will quantize."""
    def inputs(d, a, g):
        t = make(d, a, g)
        if a["with_bias"] == "yes":
            t["bias"] = randn((d["N"],), a["dtype"], g)
        if a["with_residual"] == "yes":
            t["residual"] = randn((d["M"], d["N"]), a["dtype"], g)
        if a["out"] == "int8":
            fit_out_scale(t, _epilogue_ref(base_ref(t, {}, d, a), t, {**a, "out": "none"})["y"])
        return t
    return inputs


def fit_out_scale(t: dict, y: torch.Tensor) -> None:
    """The static int8 output scale that fits `y`, the output it will quantize."""
    t["out_scale"] = (y.abs().amax().clamp_min(1e-6) / 127.0).float().reshape(1)


def _contraction_op(name: str, doc: str, dims: tuple, inputs: tuple, attrs: dict, prologue, base_ref, make,
                    check=lambda d, a: None, dequant: tuple[str, str] = ()) -> Op:
    """A GEMM op: `prologue(attrs)` gives (Contract statement, scaled accumulator expression)."""
    def build(a):
        con, y = prologue(a)
        return (con, *_out(y, a))

    return Op(name=name, kclass="contraction", doc=doc, dims=dims, row_dims=("M",),
              inputs=inputs + EPILOGUE_INPUTS, outputs=OUTPUTS, domain=(M, N), attrs={**attrs, **EPILOGUE},
              build=build, reference=lambda t, p, d, a: _epilogue_ref(base_ref(t, p, d, a), t, a),
              make_inputs=_with_epilogue(make, base_ref), check_dims=check, fused_attrs=tuple(EPILOGUE),
              dequant=dequant)


def _xw_inputs(d, a, g, w_dtype: str | None = None) -> dict:
    x = randn((d["M"], d["K"]), a["dtype"], g)
    w = torch.randn((d["N"], d["K"]), generator=g) / d["K"] ** 0.5
    return {"x": x, "w": w.to(dtypes.TORCH[w_dtype or a["dtype"]])}


GEMM = _contraction_op(
    "gemm", "y = epilogue(x @ w.T) (fp16/bf16, fp32 accumulation)", ("M", "N", "K"),
    (TensorSpec("x", (M, K), DTYPE), TensorSpec("w", (N, K), DTYPE)), {"dtype": HALF},
    lambda a: (Contract("acc", Load("x", (r, k)), Load("w", (c, k)), K, DTYPE), Ref("acc")),
    lambda t, p, d, a: f64(t["x"]) @ f64(t["w"]).T, lambda d, a, g: _xw_inputs(d, a, g))


def _w8a16_inputs(d, a, g) -> dict:
    x = randn((d["M"], d["K"]), a["dtype"], g)
    qw = quantize_rtn(torch.randn((d["N"], d["K"]), generator=g), bits=8)
    return {"x": x, "w": qw.codes, "w_scale": qw.scales[:, 0].contiguous()}


def _w8_weight_ref(t, d, a) -> torch.Tensor:
    return f64(t["w"]) * f64(t["w_scale"])[:, None]


W8A16 = _contraction_op(
    "gemm_w8a16", "y = epilogue(x @ (w_int8 * w_scale[n]).T): int8 weights, per-channel fp32 scales, "
    "fp16/bf16 activations", ("M", "N", "K"),
    (TensorSpec("x", (M, K), DTYPE), TensorSpec("w", (N, K), "int8"), TensorSpec("w_scale", (N,), "fp32")),
    {"dtype": HALF},
    lambda a: (Contract("acc", Load("x", (r, k)), Load("w", (c, k)), K, DTYPE), Ref("acc") * Load("w_scale", (c,))),
    lambda t, p, d, a: f64(t["x"]) @ _w8_weight_ref(t, d, a).T, _w8a16_inputs, dequant=("dequant_w8a16", "gemm"))


def _w4_codes(a) -> E.Expr:
    """The int4 code at (c, k) less its zero point."""
    return int4_code("w_packed") - (Const(8) if a["zp"] == "sym" else Load("zeros", (c, k // Dim("G"))))


def _w4_weight(a) -> E.Expr:
    """The dequantized weight at (c, k); per-channel scales have G = K, so k // G is their column 0."""
    return _w4_codes(a) * Load("scales", (c, k // Dim("G")))


def _w4_prologue(a) -> tuple:
    if a["group"] == "channel":
        return Contract("acc", Load("x", (r, k)), _w4_codes(a), K, DTYPE), Ref("acc") * Load("scales", (c, 0))
    return Contract("acc", Load("x", (r, k)), _w4_weight(a), K, DTYPE), Ref("acc")


def _w4_inputs(d, a, g) -> dict:
    x = randn((d["M"], d["K"]), a["dtype"], g)
    qw = quantize_rtn(torch.randn((d["N"], d["K"]), generator=g), bits=4, group=d["G"],
                      symmetric=a["zp"] == "sym")
    t = {"x": x, "w_packed": pack_int4(qw.codes), "scales": qw.scales.to(dtypes.TORCH[a["dtype"]])}
    if qw.zeros is not None:
        t["zeros"] = qw.zeros.to(torch.int8)
    return t


def int4_weight(packed: torch.Tensor, scales: torch.Tensor, k: int, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 [rows, k] weight of int4 codes packed by `pack_int4` ([rows, words]) with group scales
    (and zero points, else 8) [rows, k // G]: (code - zero) * scale, exact, never rounded to the
    activations' 16-bit dtype. The int4 tiles compute this: codes (exact in any float) times x summed
    per group in fp32, the group's scale applied to the sum (int4_gemv.py `int4_terms`, int4_mma.py)."""
    group = k // scales.shape[-1]
    zero = f64(zeros) if zeros is not None else torch.full_like(f64(scales), 8.0)
    codes = unpack_int4(packed, k).to(torch.float64)
    return (codes - zero.repeat_interleave(group, 1)) * f64(scales).repeat_interleave(group, 1)


def _w4_weight_ref(t, d, a) -> torch.Tensor:
    return int4_weight(t["w_packed"], t["scales"], d["K"], t["zeros"] if a["zp"] == "asym" else None)


def _w4_reference(t, p, d, a) -> torch.Tensor:
    return f64(t["x"]) @ _w4_weight_ref(t, d, a).T


def _w4_dims(d, a) -> str | None:
    if a["group"] == "channel" and d["G"] != d["K"]:
        return f"per-channel scales need G=K (got G={d['G']}, K={d['K']})"
    if d["K"] % d["G"]:
        return f"K={d['K']} must be a multiple of the group size G={d['G']}"
    return None


W4A16 = _contraction_op(
    "gemm_w4a16", "y = epilogue(x @ dequant(w_int4).T): 4-bit weights packed 8 per int32 (interleaved, "
    "flashgen/quant.py), group or per-channel scales, symmetric or with zero points", ("M", "N", "K", "G"),
    (TensorSpec("x", (M, K), DTYPE),
     TensorSpec("w_packed", (N, packed_words(K)), "int32"),
     TensorSpec("scales", (N, K // Dim("G")), DTYPE),
     TensorSpec("zeros", (N, K // Dim("G")), "int8", when=(("zp", ("asym",)),))),
    # group: scales per G consecutive k (applied in the k loop), or channel: G=K, applied to the sum.
    # pack: the packed layout the kernels read (a new layout is a new workload, with records of its own).
    {"dtype": HALF, "zp": ("sym", "asym"), "group": ("group", "channel"), "pack": ("k128",)},
    _w4_prologue, _w4_reference, _w4_inputs, _w4_dims, dequant=("dequant_w4a16", "gemm"))


def _scaled_inputs(d, a, g, qdtype: str) -> dict:
    from flashgen.oplib._common import quantize_ref
    xf = torch.randn((d["M"], d["K"]), generator=g, dtype=torch.float64)
    wf = torch.randn((d["N"], d["K"]), generator=g, dtype=torch.float64)
    xq, xs = quantize_ref(xf, qdtype)
    wq, ws = quantize_ref(wf, qdtype)
    t = dtypes.TORCH[qdtype]
    return {"x": xq.to(t), "x_scale": xs.float(), "w": wq.to(t), "w_scale": ws.float()}


def _scaled_reference(t, p, d, a) -> torch.Tensor:
    return (f64(t["x"]) * f64(t["x_scale"])[:, None]) @ (f64(t["w"]) * f64(t["w_scale"])[:, None]).T


def _scaled(name: str, qdtype: str, acc: str, doc: str, check=lambda d, a: None) -> Op:
    return _contraction_op(
        name, doc, ("M", "N", "K"),
        (TensorSpec("x", (M, K), qdtype), TensorSpec("x_scale", (M,), "fp32"),
         TensorSpec("w", (N, K), qdtype), TensorSpec("w_scale", (N,), "fp32")), {"dtype": HALF},
        lambda a: (Contract("acc", Load("x", (r, k)), Load("w", (c, k)), K, qdtype, acc),
                   Ref("acc") * Load("x_scale", (r,)) * Load("w_scale", (c,))),
        _scaled_reference, lambda d, a, g: _scaled_inputs(d, a, g, qdtype), check)


W8A8 = _scaled("gemm_w8a8", "int8", "int32",
               "y = (x_int8 @ w_int8.T) * x_scale[m] * w_scale[n]: int8 tensor cores, int32 accumulation, "
               "per-token and per-channel scales fused")
FP8 = _scaled("gemm_fp8", "fp8e4m3", "fp32",
              "y = (x_fp8 @ w_fp8.T) * x_scale[m] * w_scale[n]: e4m3 operands, fp32 accumulation (sm_90)")


W4A8_MAX_K = (2 ** 31 - 1) // (128 * 128)  # int32 sums of K products |x| <= 128, |(u - 8) * s_group| <= 128 stay exact


def _w4a8_code(a) -> E.Expr:
    """The signed code u - 8 at (c, k), in the layout the `pack` attr names (flashgen/quant.py PACKS)."""
    return int4_lane("w_packed") if a["pack"] == "lanes" else int4_code("w_packed") - Const(8)


def _w4a8_weight(a) -> E.Expr:
    """The int8 operand at (c, k): (u - 8) * s_group (u - 8 per channel)."""
    w = _w4a8_code(a)
    return w * Load("w_group", (c, k // Dim("G"))) if a["group"] == "group" else w


def _w4a8_prologue(a) -> tuple:
    """int8 x times the weight's int8 value (u - 8) * s_group, summed exactly in int32; the fp32 scales
    multiply the sum."""
    return (Contract("acc", Load("x", (r, k)), _w4a8_weight(a), K, "int8", "int32"),
            Ref("acc") * Load("x_scale", (r,)) * Load("w_scale", (c,)))


def _w4a8_inputs(d, a, g) -> dict:
    from flashgen.oplib._common import quantize_ref
    xq, xs = quantize_ref(torch.randn((d["M"], d["K"]), generator=g, dtype=torch.float64), "int8")
    qw = quantize_w4a8(torch.randn((d["N"], d["K"]), generator=g), group=d["G"] if a["group"] == "group" else None)
    t = {"x": xq.to(torch.int8), "x_scale": xs.float(), "w_packed": PACKS[a["pack"]][0](qw.codes),
         "w_scale": qw.channel_scales}
    if qw.group_scales is not None:
        t["w_group"] = qw.group_scales
    return t


def _w4a8_operand_ref(t, d, a) -> torch.Tensor:
    q = PACKS[a["pack"]][1](t["w_packed"], d["K"]).to(torch.float64) - 8.0
    return q * f64(t["w_group"]).repeat_interleave(d["G"], 1) if a["group"] == "group" else q


def _w4a8_weight_ref(t, d, a) -> torch.Tensor:
    return _w4a8_operand_ref(t, d, a) * f64(t["w_scale"])[:, None]


def _w4a8_dims(d, a) -> str | None:
    if d["K"] > W4A8_MAX_K:
        return f"K={d['K']} exceeds {W4A8_MAX_K}, beyond which int32 sums of int8 products may overflow"
    return _w4_dims(d, a)


W4A8 = _contraction_op(
    "gemm_w4a8", "y = epilogue((x_int8 @ w8.T) * x_scale[m] * w_scale[n]), w8 = (u_int4 - 8) * w_group[n, k // G]: "
    "4-bit weights packed 8 per int32 (pack k128: gemm_w4a16's layout; lanes: signed nibbles that one AND "
    "turns into four int8 lanes, flashgen/quant.py), an int8 second-level group scale in 1..16, int8 tensor "
    "cores summing exactly in int32 (K <= 131071: |x| <= 128 and |w8| <= 128), per-token and per-channel "
    "scales fused", ("M", "N", "K", "G"),
    (TensorSpec("x", (M, K), "int8"), TensorSpec("x_scale", (M,), "fp32"),
     TensorSpec("w_packed", (N, packed_words(K)), "int32"), TensorSpec("w_scale", (N,), "fp32"),
     TensorSpec("w_group", (N, K // Dim("G")), "int8", when=(("group", ("group",)),))),
    {"dtype": HALF, "group": ("group", "channel"), "pack": ("k128", "lanes")}, _w4a8_prologue,
    lambda t, p, d, a: (f64(t["x"]) * f64(t["x_scale"])[:, None]) @ _w4a8_weight_ref(t, d, a).T,
    _w4a8_inputs, _w4a8_dims, dequant=("dequant_w4a8", "gemm_w8a8"))


def _w4fp8_prologue(a) -> tuple:
    """e4m3 x times the int4 code u - 8 (exact in e4m3), each group's fp32 sum times its scale (per
    channel: the whole sum), then x's per-token scale."""
    sym = {"zp": "sym"}
    if a["group"] == "channel":
        return (Contract("acc", Load("x", (r, k)), _w4_codes(sym), K, "fp8e4m3", "fp32"),
                Ref("acc") * Load("scales", (c, 0)) * Load("x_scale", (r,)))
    return Contract("acc", Load("x", (r, k)), _w4_weight(sym), K, "fp8e4m3", "fp32"), Ref("acc") * Load("x_scale", (r,))


def _w4fp8_inputs(d, a, g) -> dict:
    from flashgen.oplib._common import quantize_ref
    xq, xs = quantize_ref(torch.randn((d["M"], d["K"]), generator=g, dtype=torch.float64), "fp8e4m3")
    t = _w4_inputs(d, {**a, "zp": "sym"}, g)
    return {**t, "x": xq.to(dtypes.TORCH["fp8e4m3"]), "x_scale": xs.float()}


W4FP8 = _contraction_op(
    "gemm_w4fp8", "y = epilogue(((x_fp8 @ (u_int4 - 8).T) per group * scales[n, k // G]) * x_scale[m]): "
    "gemm_w4a16's 4-bit weights and group scales (symmetric, pack k128) times e4m3 activations quantized "
    "per token, on fp8 tensor cores (sm_90), each group's fp32 sum times its scale",
    ("M", "N", "K", "G"),
    (TensorSpec("x", (M, K), "fp8e4m3"), TensorSpec("x_scale", (M,), "fp32"),
     TensorSpec("w_packed", (N, packed_words(K)), "int32"),
     TensorSpec("scales", (N, K // Dim("G")), DTYPE)),
    {"dtype": HALF, "group": ("group", "channel"), "pack": ("k128",)}, _w4fp8_prologue,
    lambda t, p, d, a: (f64(t["x"]) * f64(t["x_scale"])[:, None]) @ int4_weight(t["w_packed"], t["scales"], d["K"]).T,
    _w4fp8_inputs, _w4_dims)


def dequant_form(base: Op, weight, weight_ref, out_dtype: str = DTYPE) -> Op:
    """The weight prologue of `base` (`weight(attrs)`, over (c, k)) as a pointwise op over (N, K)
    that writes the weight in `out_dtype` (the activation dtype, or int8 for an int8 operand):
    `base.dequant`'s first op. Schedules with `dequant_first` run it and then the dense GEMM on its
    output; at thousands of rows the matrix tiles then do no unpacking, and the weight's round trip
    through memory costs a few percent of their time (schedules/contraction_space.py). Its inputs are
    the tensors the weight loads under some attrs."""
    axes = {"c": r, "k": c}  # the weight's (column of y, k) are this op's (row, column)
    attrs = {a: v for a, v in base.attrs.items() if a not in EPILOGUE}
    loaded = {n.tensor for values in itertools.product(*attrs.values())
              for n in E.walk(weight(dict(zip(attrs, values)))) if isinstance(n, Load)}
    weight_in = tuple(t for t in base.inputs if t.name in loaded)
    plain = {a: v[0] for a, v in EPILOGUE.items()}

    def build(a) -> tuple:
        w = E.transform(weight(a), lambda n: axes.get(n.axis, n) if isinstance(n, Index) else n)
        return (Store("weight", (r, c), w),)

    def make_inputs(d, a, g) -> dict:
        t = base.make_inputs({**d, "M": 1}, {**a, **plain}, g)
        return {n: v for n, v in t.items() if n in {s.name for s in weight_in}}

    return Op(name=base.dequant[0], kclass="pointwise", doc=f"the weight of {base.name}, " + ("dequantized to the activation dtype" if out_dtype == DTYPE
                                                   else f"as the {out_dtype} operand of {base.dequant[1]}"),
              dims=tuple(d for d in base.dims if d != "M"), row_dims=("N",), inputs=weight_in,
              outputs=(TensorSpec("weight", (N, K), out_dtype),), domain=(N, K), attrs=attrs, build=build,
              reference=lambda t, p, d, a: {"weight": weight_ref(t, d, a)}, make_inputs=make_inputs,
              check_dims=base.check_dims)


DEQUANT_W8A16 = dequant_form(W8A16, lambda a: Load("w", (c, k)) * Load("w_scale", (c,)), _w8_weight_ref)
DEQUANT_W4A16 = dequant_form(W4A16, _w4_weight, _w4_weight_ref)
# w4a8's int8 operand, for gemm_w8a8 (its per-channel scale is the dense op's w_scale)
DEQUANT_W4A8 = dequant_form(W4A8, _w4a8_weight, _w4a8_operand_ref, out_dtype="int8")

PARAMS = {"eps": 1e-6}  # the fused norm's


def _fused_dequant(base: Op, prefix: str) -> tuple[str, str]:
    """A fused variant's weight dequantizes as its base's, and the dense op runs the same fusion."""
    return (base.dequant[0], prefix + base.dequant[1]) if base.dequant else ()


def rmsnorm_fused(base: Op) -> Op:
    """`rmsnorm_<op>`: y = op(rmsnorm(x) * norm_w), for a linear that a norm feeds: a row pass sums
    the squares of each row of x (the statements before the Contract), and the prologue scales x by
    the row's inverse root and the norm's weight. Tiles evaluate the pass as suits them
    (targets/triton/contraction.py). A decode step so needs no norm kernel, and no launch, between
    the residual stream and the linear; the residual add moves into the epilogue of the linear
    before (`with_residual`)."""
    x = Load("x", (r, k))

    def build(a) -> tuple:
        stmts = base.body(a)
        [con] = [st for st in stmts if isinstance(st, Contract)]
        assert con.a == x, f"{base.name}: only a plain x prologue can take a norm"
        normed = replace(con, a=x * Ref("inv") * Load("norm_w", (k,)))
        return (*rms_inverse(x, K), *(normed if st is con else st for st in stmts))

    def normed_inputs(t: dict, p) -> dict:
        return {**t, "x": _rms(f64(t["x"]), f64(t["norm_w"]), p["eps"])}

    def reference(t, p, d, a) -> dict:
        return base.reference(normed_inputs(t, p), p, d, a)

    def make_inputs(d, a, g) -> dict:
        t = base.make_inputs(d, a, g)
        t["norm_w"] = randn((d["K"],), a["dtype"], g, 1.0, 0.2)
        if a["out"] == "int8":  # the output scale fits the normalized product
            fit_out_scale(t, reference(t, PARAMS, d, {**a, "out": "none"})["y"])
        return t

    inputs = (base.inputs[0], TensorSpec("norm_w", (K,), DTYPE), *base.inputs[1:])  # required before optional
    return replace(base, name=f"rmsnorm_{base.name}", doc=f"{base.doc}, x RMS-normalized on the way in (rmsnorm(x) * norm_w)",
                   inputs=inputs, build=build, reference=reference, make_inputs=make_inputs,
                   params=PARAMS, plain=base.name, dequant=_fused_dequant(base, "rmsnorm_"))


def silu_mul_fused(base: Op) -> Op:
    """`silu_mul_<op>`: y = op(silu(g) * u) with x = [g | u] (M x 2K), for the MLP's down projection:
    the prologue gates x as it loads it, so that a decode step launches no SiLU·mul kernel between
    the gate/up projection and the down one."""
    x = Load("x", (r, k))
    xg = Load("xg", (r, k))
    gated = xg * sigmoid(xg) * Load("xg", (r, k + K))

    def build(a) -> tuple:
        stmts = base.body(a)
        [con] = [st for st in stmts if isinstance(st, Contract)]
        assert con.a == x, f"{base.name}: only a plain x prologue can take a gate"
        return tuple(replace(con, a=gated) if st is con else st for st in stmts)

    def gated_inputs(t: dict) -> dict:
        x = _silu_mul(f64(t["xg"]), t["xg"].shape[-1] // 2)["y"]
        return {**{n: v for n, v in t.items() if n != "xg"}, "x": x}

    def make_inputs(d, a, g) -> dict:
        t = base.make_inputs(d, a, g)
        t["xg"] = randn((d["M"], 2 * d["K"]), a["dtype"], g)
        del t["x"]
        if a["out"] == "int8":
            fit_out_scale(t, base.reference(gated_inputs(t), {}, d, {**a, "out": "none"})["y"])
        return t

    inputs = (TensorSpec("xg", (M, Const(2) * K), DTYPE), *base.inputs[1:])
    return replace(base, name=f"silu_mul_{base.name}", doc=f"{base.doc}, x = silu(g) * u of xg = [g | u] (M x 2K)",
                   inputs=inputs, build=build, reference=lambda t, p, d, a: base.reference(gated_inputs(t), p, d, a),
                   make_inputs=make_inputs, plain=base.name, dequant=_fused_dequant(base, "silu_mul_"))


OPS = (GEMM, W8A16, W4A16, W8A8, W4A8, FP8, W4FP8, DEQUANT_W8A16, DEQUANT_W4A16, DEQUANT_W4A8) + tuple(f(op) for f in (rmsnorm_fused, silu_mul_fused)
                                             for op in (GEMM, W8A16, W4A16))
