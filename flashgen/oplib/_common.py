"""Pieces the op definitions share: index shorthands, random inputs, float64 helpers."""
from __future__ import annotations

from flashgen.lazy import lazy

torch = lazy("torch")

from flashgen.ir import dtypes
from flashgen.ir.expr import Dim, Index

r, c = Index("r"), Index("c")
M, N = Dim("M"), Dim("N")
FLOAT_DTYPES = ("bf16", "fp16", "fp32")


def randn(shape: tuple[int, ...], dtype: str, gen: torch.Generator, mean: float = 0.0,
          std: float = 1.0) -> torch.Tensor:
    """Fresh normal data in the tensor's dtype (never zeros: they hide unwritten outputs)."""
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean
    return t.to(dtypes.TORCH[dtype])


def f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def quantize_ref(y: torch.Tensor, out_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric quantization in float64: returns (values on the output grid, per-row scale)."""
    qmax = dtypes.QMAX[out_dtype]
    scale = y.abs().amax(dim=-1).clamp_min(1e-10) / qmax
    q = (y / scale[..., None]).clamp(-qmax, qmax)
    if out_dtype == "int8":
        q = torch.round(q)
    else:
        q = q.to(dtypes.TORCH[out_dtype]).to(torch.float64)
    return q, scale

