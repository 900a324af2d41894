"""A linear layer's call in any mode (runtime/decoder/quant_modes.py: each mode's weights and GEMM), and the
per-call choice of the mixed mode.

A linear may take the RMSNorm that feeds it (`norm`), a gated input (`gated`: x = [g | u], the
linear's input being silu(g) * u) and the residual it adds (`residual`, the GEMM's epilogue). In the
modes that fuse them (`QuantLinear.fused`: bf16), up to FUSED_MAX_ROWS rows, the norm and the gate run
inside the GEMM (the `rmsnorm_` and `silu_mul_` ops), and a decode step launches no kernel for them;
otherwise their own kernels run first. On the H200 at batch 1 (benchmarks/results/model_fused_rows.md),
fused norms and gates gave the bf16 decoder 238 tokens/s against 233; at 16 rows the matrix tiles' row
pass (each program normalizes its rows again before its k loop) cost 12%, and the int4 GEMVs, which are
issue-bound, lost 2% to the norm's extra work on x. Modes whose activations are quantized normalize and
quantize them in one kernel (rmsnorm_quant).

A mixed linear computes each call in the mode its chooser picks for the call's row count
(runtime/decoder/mixed.py `ModePlan`: decided per layer shape at load from the records dispatch would
serve, else the roofline).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from flashgen.runtime.decoder.quant_modes import QuantLinear

FUSED_MAX_ROWS = 1


@dataclass(frozen=True)
class CallForm:
    """What a decoder linear's every call brings with it (the arguments of `apply` beside x): the mixed
    mode estimates a mode's call as the decoder makes it, so that the norm a 16-bit mode runs apart
    and an int8 mode fuses with its quantization, and a residual epilogue, are counted where they run."""
    norm: bool = False
    gated: bool = False
    residual: bool = False
    bias: bool = False


PLAIN = CallForm()


def apply(x: torch.Tensor, q: QuantLinear, bias: torch.Tensor | None, fallbacks: set[str],
          chooser: Callable[[int, int, int], str] | None = None, norm: torch.Tensor | None = None,
          eps: float = 1e-6, gated: bool = False, residual: torch.Tensor | None = None,
          ops: Any = None) -> torch.Tensor:
    """y = linear(x') + bias + residual in `q`'s mode, x' being rmsnorm(x) * norm when `norm` is given,
    silu(g) * u of x = [g | u] when `gated`, else x; `chooser(n, k, m)` picks a mixed linear's mode.
    `ops` stands for a GPU's `torch.ops.flashgen` where given (runtime/decoder/calls.py records the
    kernels a call launches so, whatever the tensors' device)."""
    q = q.choose(x.shape[0], chooser)
    gpu = ops is not None or x.device.type == "cuda"
    fused = gpu and q.fused and x.shape[0] <= FUSED_MAX_ROWS
    ops = ops if ops is not None else torch.ops.flashgen
    if norm is not None and not fused and (q.activations is None or not gpu):
        x, norm = ops.rmsnorm(x, norm, eps), None
    if gated and not fused:
        x, gated = ops.silu_mul(x), False
    if not gpu:
        y = q.cpu_product(x, bias)
        if q.cpu_fallback:
            fallbacks.add(q.cpu_fallback)
        return y if residual is None else y + residual
    epi = {"with_bias": "yes", "bias": bias} if bias is not None else {}
    if residual is not None:
        epi.update(with_residual="yes", residual=residual)
    prologue, arg = ("silu_mul_", "xg") if gated else ("rmsnorm_", "x") if norm is not None else ("", "x")
    return q.gemm(ops, x, prologue, {arg: x, **({"norm_w": norm, "eps": eps} if norm is not None else {}), **epi}, epi)
