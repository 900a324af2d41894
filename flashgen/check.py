"""Correctness checks: a kernel's outputs against the op's float64 reference on fresh random inputs.

Outputs are poisoned first (NaN, -128 for int8, a value quantization never produces, or -2**31 for
int32 indices), so an element the kernel does not write fails the check; int32 outputs must match
exactly. Float outputs are judged by the relative error norm
||out - ref|| / ||ref|| with a tolerance that fits the dtype's rounding (fp32 outputs of a contraction
also the rounding of its fp32 sums, which grows with their length); quantized int8 outputs may
differ from the reference by one step (fp32 vs float64 rounding at ties), in at most 1% of elements.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from flashgen.ir import dtypes
from flashgen.ir.op import Contract, eval_int
from flashgen.workload import Workload

REL_TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.2e-2, "fp8e4m3": 2e-2}
# fp32 sums of n products: a relative error of about sqrt(n) fp32 steps, with this margin (matrix
# units' accumulators measured at 1.8 steps of sqrt(n) for n = 14336 on an H200)
FP32_SUM_STEPS = 4.0
INT8_MAX_STEP, INT8_MAX_FRACTION = 1, 0.01
POISON_INT = {"int8": -128, "int32": -(1 << 31)}  # values neither quantization nor an index produces


@dataclass(frozen=True)
class OutputCheck:
    tensor: str
    error: float          # relative error norm, or the fraction of int8 elements off by one step
    tolerance: float
    ok: bool
    detail: str = ""


def poisoned(wl: Workload, dims: Mapping[str, int], device: torch.device | str) -> dict[str, torch.Tensor]:
    out = {}
    for t in wl.outputs:
        dt = wl.tensor_dtype(t.name)
        shape = tuple(eval_int(e, dims) for e in t.shape)
        fill = POISON_INT.get(dt, float("nan"))
        out[t.name] = torch.full(shape, fill, dtype=dtypes.TORCH[dt], device=device)
    return out


def tolerance(wl: Workload, dt: str) -> float:
    """The relative error norm allowed in an output of dtype `dt` (module docstring)."""
    sums = [eval_int(st.extent, wl.dim) for st in wl.op.body(wl.attr) if isinstance(st, Contract)]
    if dt != "fp32" or not sums:
        return REL_TOL[dt]
    return max(REL_TOL[dt], FP32_SUM_STEPS * math.sqrt(max(sums)) * 2.0 ** -24)


def compare(wl: Workload, outs: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> list[OutputCheck]:
    checks = []
    for name, want in ref.items():
        dt = wl.tensor_dtype(name)
        got = outs[name].detach()
        want = want.detach().to(got.device, torch.float64)
        if dt == "int8":
            if (got == -128).any():
                checks.append(OutputCheck(name, 1.0, INT8_MAX_FRACTION, False, "unwritten elements"))
                continue
            diff = (got.to(torch.float64) - want).abs()
            frac = (diff > 0).double().mean().item() if diff.numel() else 0.0
            worst = diff.max().item() if diff.numel() else 0.0
            ok = worst <= INT8_MAX_STEP and frac <= INT8_MAX_FRACTION
            checks.append(OutputCheck(name, frac, INT8_MAX_FRACTION, ok, f"max step {worst:g}"))
            continue
        if dt == "int32":  # indices: exact
            wrong = (got.to(torch.float64) != want).sum().item()
            checks.append(OutputCheck(name, float(wrong), 0.0, wrong == 0, f"{wrong} of {got.numel()} differ"))
            continue
        g, tol = got.to(torch.float64), tolerance(wl, dt)
        if not torch.isfinite(g).all():
            checks.append(OutputCheck(name, float("inf"), tol, False, "NaN/inf or unwritten elements"))
            continue
        denom = want.norm().item()
        err = (g - want).norm().item() / (denom if denom > 0 else 1.0)
        checks.append(OutputCheck(name, err, tol, err <= tol))
    return checks


Run = Callable[[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], Mapping[str, float]], None]


def check(wl: Workload, run: Run, seed: int, device: torch.device | str = "cpu",
          params: Mapping[str, float] | None = None) -> list[OutputCheck]:
    """Draw fresh inputs from `seed`, run into poisoned outputs with the op's params (defaults, or
    those given), compare with the float64 reference."""
    gen = torch.Generator().manual_seed(seed)
    inputs = wl.op.make_inputs(wl.dim, wl.attr, gen)
    outs = poisoned(wl, wl.dim, device)
    full = {**wl.op.params, **(params or {})}
    ref = wl.op.reference(inputs, full, wl.dim, wl.attr)   # before the run: it may update inputs in place
    given = {k: v.to(device, copy=True) for k, v in inputs.items()}
    run(given, outs, full)
    return compare(wl, judged(wl, outs, given), ref)


def judged(wl: Workload, outs: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a run is judged on: its outputs, and the inputs it updates in place (a KV cache),
    which the reference gives whole, as they should be after the call."""
    return {**outs, **{t.name: inputs[t.name] for t in wl.inputs if t.written}}
