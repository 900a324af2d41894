"""Linear layers of the decoder in each compute mode, and the per-call choice between them.

Modes: bf16 (the weight as is), w8a16 and w4a16 (weight-only int8 / int4, RTN-quantized at load, int4
in groups of 128 along K where K allows, else per channel), w8a8 (int8 weights and per-token dynamically
quantized int8 activations), and mixed: each call picks w4a16 or w8a8 for its row count M from the
tuning database's measurements of both on this layer's shape (small M is bandwidth-bound and favours
4-bit weights, large M compute-bound and favours int8 tensor cores), falling back to a crossover of
M = 64 where nothing is measured. On a GPU each mode runs its generated GEMM; on the CPU torch
multiplies (reported as a fallback): w8a8 as gemm_w8a8 computes (activations quantized per token by the
generated dynamic_quant kernel, int8 products summed in int32, scaled per token and per channel), so
that a CPU run previews the GPU's numerics, and the weight-only modes on the dequantized weight, a
float32 weight reordered once for oneDNN (`cpu_weight`); mixed picks per call on both.

A linear may take the RMSNorm that feeds it (`norm`), a gated input (`gated`: x = [g | u], the
linear's input being silu(g) * u) and the residual it adds (`residual`, the GEMM's epilogue). In the
FUSED_MODES, up to FUSED_MAX_ROWS rows, the norm and the gate run inside the GEMM (the `rmsnorm_` and
`silu_mul_` ops), and a decode step launches no kernel for them; otherwise their own kernels run
first. On the H200 at batch 1 (benchmarks/results/model_fused_*.md), fused norms and gates gave the
bf16 decoder 238 tokens/s against 233; at 16 rows the matrix tiles' row pass (each program
normalizes its rows again before its k loop) cost 12%, and the int4 GEMVs, which are issue-bound,
lost 2% to the norm's extra work on x. w8a8 normalizes and quantizes its activations in one kernel
(rmsnorm_quant).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashgen.errors import FlashgenError
from flashgen.ir import dtypes
from flashgen.quant import pack_int4, quantize_rtn
from flashgen.runtime.buckets import best_records, nearest
from flashgen.workload import recorded_workload

MODES = ("bf16", "w8a16", "w4a16", "w8a8", "mixed")
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


def prepare(w: torch.Tensor, mode: str) -> QuantLinear:
    """The layer's weights for `mode`, quantized where the weight lies (a GPU quantizes an 8B model in
    seconds). A GPU keeps only the quantized weights; the CPU, whose weight-only modes torch multiplies
    dequantized, keeps that copy too (mixed: of the int4 weight; w8a8 multiplies its int8 codes)."""
    if mode not in MODES:
        raise FlashgenError(f"unknown quantization mode {mode!r}; valid: {', '.join(MODES)}")
    shape = (w.shape[0], w.shape[1])
    if mode == "bf16":
        return QuantLinear(shape, cpu_weight(w))
    q = QuantLinear(shape, None)
    torch_path = None  # the quantized weight that the CPU's weight-only path multiplies, dequantized
    if mode in ("w8a16", "w8a8", "mixed"):
        q8 = quantize_rtn(w, bits=8)
        q.w8, q.w8_scale = q8.codes, q8.scales[:, 0].contiguous()
        torch_path = q8 if mode == "w8a16" else None
    if mode in ("w4a16", "mixed"):
        k = w.shape[1]
        q.group = 128 if k % 128 == 0 else k
        q4 = quantize_rtn(w, bits=4, group=q.group)
        q.w4, q.w4_scales = pack_int4(q4.codes), q4.scales.to(w.dtype)
        torch_path = q4
    if w.device.type != "cuda" and torch_path is not None:
        q.weight = cpu_weight(torch_path.dequantize().to(w.dtype))
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


def choose(db_path, n: int, k: int, m: int, target_id: str) -> str:
    """w4a16 or w8a8 for an M x N x K call, by the fastest measured workload of each at the nearest
    measured M (`buckets.nearest`: at or above m, else the largest below; records of a workload defined
    otherwise today are not counted); the M=64 crossover where one is unmeasured. The records are read
    once per database state (`buckets.best_records`)."""
    best: dict[str, float] = {}
    records = best_records(db_path, target_id)
    for mode, op in (("w4a16", "gemm_w4a16"), ("w8a8", "gemm_w8a8")):
        pick = nearest([(r.workload["dims"]["M"], 0.0, r) for r in records if r.workload.get("op") == op
                        and r.workload["dims"].get("N") == n and r.workload["dims"].get("K") == k
                        and recorded_workload(r.workload, r.workload_key)], m)
        if pick is not None:
            best[mode] = pick[1].latency_us
    if len(best) == 2:
        return min(best, key=best.get)
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
    if norm is not None and not fused and (mode != "w8a8" or not gpu):
        x, norm = ops.rmsnorm(x, norm, eps), None
    if gated and not fused:
        x, gated = ops.silu_mul(x), False
    if not gpu:
        y = _cpu_w8a8(x, q, bias) if mode == "w8a8" else torch_linear(x, q.weight, bias)
        if mode != "bf16":
            how = "int8 product of per-token int8 activations" if mode == "w8a8" else "the dequantized weight"
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
    if norm is not None:
        xq, xs = ops.rmsnorm_quant(x, norm, eps, out_dtype="int8")
    else:
        xq, xs = ops.dynamic_quant(x, out_dtype="int8")
    return ops.gemm_w8a8(xq, xs, q.w8, q.w8_scale, dtype=dtypes.of_torch(x.dtype), **epi)


def _cpu_w8a8(x: torch.Tensor, q: QuantLinear, bias: torch.Tensor | None) -> torch.Tensor:
    """gemm_w8a8's y = (x_int8 @ w_int8.T) * x_scale[m] * w_scale[n] + bias in torch on the CPU, x
    quantized per token by the generated dynamic_quant kernel, the sums exact in int32 as on a GPU
    (torch._int_mm: oneDNN's int8 GEMM)."""
    xq, xs = torch.ops.flashgen.dynamic_quant(x, out_dtype="int8")
    y = torch._int_mm(xq, q.w8.t()) * xs[:, None] * q.w8_scale
    return (y if bias is None else y + bias).to(x.dtype)
