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

The mixed mode's linears ask `choose` which of w4a16, w8a8 and w4a8 computes a call of M rows: the
tuning database's measurements of each on this layer's shape decide (small M is bandwidth-bound and
favours 4-bit weights, large M compute-bound and favours int8 tensor cores), falling back to a
crossover of M = 64 between w4a16 and w8a8 where fewer than two are measured.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from flashgen.runtime.serving.buckets import best_records
from flashgen.runtime.decoder.quant_modes import QuantLinear
from flashgen.workload import recorded_workload

# The modes mixed chooses among (runtime/decoder/quant_modes.py MixedLinear), and the op of each whose records decide
MIXED_OPS = {"w4a16": "gemm_w4a16", "w8a8": "gemm_w8a8", "w4a8": "gemm_w4a8"}
DEFAULT_CROSSOVER_M = 64
FUSED_MAX_ROWS = 1


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
