"""Linear layers of the decoder in each compute mode, and the per-call choice between them.

Modes: bf16 (the weight as is), w8a16 and w4a16 (weight-only int8 / int4, RTN-quantized at load, int4
in groups of 128 along K where K allows, else per channel), w8a8 (int8 weights and per-token dynamically
quantized int8 activations), w4a8 (gemm_w4a8: 4-bit weights with integer group scales on int8 tensor
cores, activations as w8a8's; flashgen/quant.py `quantize_w4a8`), fp8 (e4m3 weights with per-channel scales
and per-token dynamically quantized e4m3 activations: gemm_fp8, sm_90), and mixed: each call picks w4a16,
w8a8 or w4a8 for its row count M from the tuning database's measurements of each on this layer's shape
(small M is bandwidth-bound and favours 4-bit weights, large M compute-bound and favours int8 tensor
cores), falling back to a crossover of M = 64 between w4a16 and w8a8 where fewer than two are measured.
mixed keeps one 4-bit weight for both 4-bit modes (w4a16's scales are w4a8's two levels multiplied
out, in the activation dtype) besides the int8 one. On a GPU each mode runs its generated GEMM; on the
CPU torch multiplies (reported as a fallback): w8a8 and w4a8 as their GEMMs compute (activations
quantized per token by the generated dynamic_quant kernel, int8 products summed in int32, scaled per
token and per channel; w4a8's int8 operand is (u - 8) times its group scale; fp8's activations
quantized per token to e4m3 by the op's reference, as the cpu target has no fp8), so that a CPU run
previews the GPU's numerics, and the weight-only modes on the dequantized weight, a float32 weight
reordered once for oneDNN (`cpu_weight`); mixed picks per call on both.

A linear may take the RMSNorm that feeds it (`norm`), a gated input (`gated`: x = [g | u], the
linear's input being silu(g) * u) and the residual it adds (`residual`, the GEMM's epilogue). In the
FUSED_MODES, up to FUSED_MAX_ROWS rows, the norm and the gate run inside the GEMM (the `rmsnorm_` and
`silu_mul_` ops), and a decode step launches no kernel for them; otherwise their own kernels run
first. On the H200 at batch 1 (benchmarks/results/model_fused_*.md), fused norms and gates gave the
bf16 decoder 238 tokens/s against 233; at 16 rows the matrix tiles' row pass (each program
normalizes its rows again before its k loop) cost 12%, and the int4 GEMVs, which are issue-bound,
lost 2% to the norm's extra work on x. w8a8 and w4a8 normalize and quantize their activations in one
kernel (rmsnorm_quant).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashgen.errors import FlashgenError
from flashgen.ir import dtypes
from flashgen.oplib._common import quantize_ref
from flashgen.quant import pack_int4, quantize_fp8, quantize_rtn, quantize_w4a8
from flashgen.runtime.buckets import best_records
from flashgen.workload import recorded_workload

MODES = ("bf16", "w8a16", "w4a16", "w8a8", "w4a8", "fp8", "mixed")
# The modes `mixed` chooses among, and the op of each whose records decide
MIXED_OPS = {"w4a16": "gemm_w4a16", "w8a8": "gemm_w8a8", "w4a8": "gemm_w4a8"}
# The modes whose activations are quantized per token, and to what
QUANTIZED_ACTIVATIONS = {"w8a8": "int8", "w4a8": "int8", "fp8": "fp8e4m3"}
DEFAULT_CROSSOVER_M = 64
FUSED_MODES = ("bf16",)
FUSED_MAX_ROWS = 1


@dataclass
class QuantLinear:
    shape: tuple[int, int]                # [N, K]
    weight: torch.Tensor | None           # the float weight (bf16 mode) or its dequantized copy (cpu only)
    w8: torch.Tensor | None = None        # int8 [N, K]
    w8_scale: torch.Tensor | None = None  # fp32 [N]
    w4: torch.Tensor | None = None        # int32 [N, packed_words(K)] (flashgen/quant.py)
    w4_scales: torch.Tensor | None = None
    group: int = 0
    w4_zeros: torch.Tensor | None = None  # int8 [N, K / group]: zero points (a pre-quantized checkpoint's)
    perm: torch.Tensor | None = None      # act-order: the k order of the packed codes, x gathered so first
    w4a8_scale: torch.Tensor | None = None  # fp32 [N]: w4a8's per-channel scale (its codes are w4's)
    w4a8_group: torch.Tensor | None = None  # int8 [N, K / group] in 1..16: w4a8's group scales (None per channel)
    w4a8_int8: torch.Tensor | None = None   # int8 [N, K], cpu only: w4a8's operand (u - 8) * group scale
    f8: torch.Tensor | None = None          # float8_e4m3fn [N, K]: fp8's weight
    f8_scale: torch.Tensor | None = None    # fp32 [N]


def prepare(w: torch.Tensor, mode: str) -> QuantLinear:
    """The layer's weights for `mode`, quantized where the weight lies (a GPU quantizes an 8B model in
    seconds). A GPU keeps only the quantized weights; the CPU, whose weight-only modes torch multiplies
    dequantized, keeps that copy too (mixed: of the int4 weight), and w4a8's int8 operand on the CPU
    (u - 8) * group scale, which it multiplies as w8a8 (`_cpu_quantized`)."""
    if mode not in MODES:
        raise FlashgenError(f"unknown quantization mode {mode!r}; valid: {', '.join(MODES)}")
    shape = (w.shape[0], w.shape[1])
    if mode == "bf16":
        return QuantLinear(shape, cpu_weight(w))
    q = QuantLinear(shape, None)
    cpu = w.device.type != "cuda"
    k = w.shape[1]
    if mode in ("w4a16", "w4a8", "mixed"):
        q.group = 128 if k % 128 == 0 else k
    if mode in ("w8a16", "w8a8", "mixed"):
        q8 = quantize_rtn(w, bits=8)
        q.w8, q.w8_scale = q8.codes, q8.scales[:, 0].contiguous()
        if cpu and mode == "w8a16":
            q.weight = cpu_weight(q8.dequantize().to(w.dtype))
    if mode == "w4a16":
        q4 = quantize_rtn(w, bits=4, group=q.group)
        q.w4, q.w4_scales = pack_int4(q4.codes), q4.scales.to(w.dtype)
        if cpu:
            q.weight = cpu_weight(q4.dequantize().to(w.dtype))
    if mode in ("w4a8", "mixed"):
        qa = quantize_w4a8(w, q.group)
        q.w4, q.w4a8_scale, q.w4a8_group = pack_int4(qa.codes), qa.channel_scales, qa.group_scales
        if mode == "mixed":  # w4a16 on the same codes: the two scale levels multiplied out
            levels = qa.channel_scales[:, None] * (qa.group_scales.float() if qa.group_scales is not None else 1.0)
            q.w4_scales = levels.to(w.dtype)
            if cpu:
                q.weight = cpu_weight(qa.dequantize().to(w.dtype))
        if cpu:  # the CPU multiplies w4a8 as w8a8 does, on its int8 operand (`_cpu_quantized`)
            q.w4a8_int8 = qa.operand()
    if mode == "fp8":
        qf = quantize_fp8(w)
        q.f8, q.f8_scale = qf.values, qf.scales
        if cpu:
            q.weight = cpu_weight(qf.dequantize().to(w.dtype))
    return q


def cpu_weight(w: torch.Tensor) -> torch.Tensor:
    """A float32 CPU weight reordered for oneDNN (as torch.compile's CPU freezing does): `torch_linear`
    multiplies it 1.4-2.5x faster than F.linear does the plain tensor at 1-8 rows on these AMD EPYC
    cores, where MKL's GEMV is slow. Other weights as they are."""
    if w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)
    return w


def torch_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + bias in torch, w plain or reordered for oneDNN (`cpu_weight`)."""
    if not w.is_mkldnn:
        return F.linear(x, w, bias)
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")


def latency_at(measured: dict[int, float], m: int) -> float:
    """A GEMM's latency at M = m from its latencies at measured M: flat below the smallest (the weight's
    read bounds it), linear between two measured M, and in proportion to M above the largest (as if
    compute-bound: an upper bound, so that a mode measured at the call's M is preferred to a guess)."""
    ms = sorted(measured)
    if m <= ms[0]:
        return measured[ms[0]]
    if m >= ms[-1]:
        return measured[ms[-1]] * m / ms[-1]
    hi = next(x for x in ms if x >= m)
    lo = max(x for x in ms if x < m)
    return measured[lo] + (measured[hi] - measured[lo]) * (m - lo) / (hi - lo)


def choose(db_path, n: int, k: int, m: int, target_id: str, dtype: str | None = None) -> str:
    """The fastest of `MIXED_OPS`' modes for an M x N x K call, each mode's latency at m estimated from
    its fastest measured workloads of this N x K in the call's activation `dtype` (all dtypes when None;
    records of a workload defined otherwise today are not counted: a record of another dtype times
    another kernel than the call runs), so that modes measured at different M are compared at the call's
    (`latency_at`); where
    fewer than two modes are measured, w4a16 up to the M=64 crossover and w8a8 above it. The records
    are read once per database state (`buckets.best_records`)."""
    measured: dict[str, dict[int, float]] = {}
    ops = {op: mode for mode, op in MIXED_OPS.items()}
    for r in best_records(db_path, target_id):
        mode = ops.get(r.workload.get("op"))
        dims = r.workload["dims"]
        same_dtype = dtype is None or r.workload.get("attrs", {}).get("dtype") == dtype
        if mode and same_dtype and dims.get("N") == n and dims.get("K") == k and recorded_workload(r.workload, r.workload_key):
            at = measured.setdefault(mode, {})
            at[dims["M"]] = min(at.get(dims["M"], r.latency_us), r.latency_us)
    if len(measured) >= 2:
        return min(measured, key=lambda mode: latency_at(measured[mode], m))
    return "w4a16" if m <= DEFAULT_CROSSOVER_M else "w8a8"


def apply(x: torch.Tensor, q: QuantLinear, mode: str, bias: torch.Tensor | None, fallbacks: set[str],
          chooser=None, norm: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
          residual: torch.Tensor | None = None) -> torch.Tensor:
    """y = linear(x') + bias + residual in `mode`, x' being rmsnorm(x) * norm when `norm` is given,
    silu(g) * u of x = [g | u] when `gated`, else x."""
    n, k = q.shape
    gpu = x.device.type == "cuda"
    if mode == "mixed":
        mode = chooser(n, k, x.shape[0]) if chooser else "w4a16"
    fused = gpu and mode in FUSED_MODES and x.shape[0] <= FUSED_MAX_ROWS
    ops = torch.ops.flashgen
    if norm is not None and not fused and (mode not in QUANTIZED_ACTIVATIONS or not gpu):
        x, norm = ops.rmsnorm(x, norm, eps), None
    if gated and not fused:
        x, gated = ops.silu_mul(x), False
    if not gpu:
        quantized = QUANTIZED_ACTIVATIONS.get(mode)
        y = _cpu_quantized(x, q, mode, bias) if quantized else torch_linear(x, q.weight, bias)
        if mode != "bf16":
            how = f"{quantized} product of per-token {quantized} activations" if quantized else "the dequantized weight"
            fallbacks.add(f"{mode} linear (torch on {how} on cpu)")
        return y if residual is None else y + residual
    epi = {"with_bias": "yes", "bias": bias} if bias is not None else {}
    if residual is not None:
        epi.update(with_residual="yes", residual=residual)
    pre, arg = ("silu_mul_", "xg") if gated else ("rmsnorm_", "x") if norm is not None else ("", "x")
    args = {arg: x, **({"norm_w": norm, "eps": eps} if norm is not None else {}), **epi}
    if mode == "bf16":
        return getattr(ops, pre + "gemm")(w=q.weight, **args)
    if mode == "w8a16":
        return getattr(ops, pre + "gemm_w8a16")(w=q.w8, w_scale=q.w8_scale, **args)
    if mode == "w4a16":
        if q.perm is not None:  # (no norm nor gate fused here: they ran above, before the gather)
            args[arg] = x.index_select(1, q.perm)
        zp = {"zp": "asym", "zeros": q.w4_zeros} if q.w4_zeros is not None else {}
        return getattr(ops, pre + "gemm_w4a16")(w_packed=q.w4, scales=q.w4_scales,
                                                 group="group" if q.group != k else "channel",
                                                 dims=[x.shape[0], n, k, q.group], **zp, **args)
    qdtype = QUANTIZED_ACTIVATIONS[mode]
    if norm is not None:
        xq, xs = ops.rmsnorm_quant(x, norm, eps, out_dtype=qdtype)
    else:
        xq, xs = ops.dynamic_quant(x, out_dtype=qdtype)
    if mode == "fp8":
        return ops.gemm_fp8(xq, xs, q.f8, q.f8_scale, dtype=dtypes.of_torch(x.dtype), **epi)
    if mode == "w4a8":
        grouped = q.w4a8_group is not None
        return ops.gemm_w4a8(xq, xs, q.w4, q.w4a8_scale, **({"w_group": q.w4a8_group} if grouped else {}),
                             group="group" if grouped else "channel", dims=[x.shape[0], n, k, q.group],
                             dtype=dtypes.of_torch(x.dtype), **epi)
    return ops.gemm_w8a8(xq, xs, q.w8, q.w8_scale, dtype=dtypes.of_torch(x.dtype), **epi)


def _cpu_quantized(x: torch.Tensor, q: QuantLinear, mode: str, bias: torch.Tensor | None) -> torch.Tensor:
    """gemm_w8a8's (and gemm_w4a8's) y = (x_int8 @ w_int8.T) * x_scale[m] * w_scale[n] + bias in torch
    on the CPU, x quantized per token by the generated dynamic_quant kernel, the sums exact in int32 as
    on a GPU (torch._int_mm: oneDNN's int8 GEMM); w4a8's int8 operand is (u - 8) * group scale. fp8:
    x quantized per token to e4m3 by dynamic_quant's reference (the cpu target has no fp8), times the
    dequantized weight in float32."""
    if mode == "fp8":
        xq, xs = quantize_ref(x.float(), "fp8e4m3")
        return torch_linear((xq * xs[:, None]).to(x.dtype), q.weight, bias)
    xq, xs = torch.ops.flashgen.dynamic_quant(x, out_dtype="int8")
    w8, scale = (q.w4a8_int8, q.w4a8_scale) if mode == "w4a8" else (q.w8, q.w8_scale)
    y = torch._int_mm(xq, w8.t()) * xs[:, None] * scale
    return (y if bias is None else y + bias).to(x.dtype)
