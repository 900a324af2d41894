"""Contractions that dequantize their weight first (the `dq_` variants): two launches, one kernel.

A quantized GEMM's weight prologue (int4 codes less their zero point, times their scale) runs as its
own pointwise kernel (the op's `dequant` form, flashgen/oplib/gemm.py), which writes the weight in the
activation dtype to a scratch buffer; the dense GEMM then runs on that buffer with the schedule's
tiles. The matrix tiles so take plain 16-bit operands (TMA copies on sm_90) and no unpacking work,
which pays where thousands of rows share each weight tile; the space offers it only there
(schedules/contraction_space.py).

With `dequant_chunks` = c > 1 the weight's N rows go in c equal chunks: on a GPU the dequant of chunk
j + 1 runs on a side stream while the GEMM of chunk j runs on the caller's (a GEMM kernel compiled for
N / c columns, on views of the outputs and of the epilogue's per-column tensors), so that only the
first chunk's dequant is not hidden behind the compute-bound GEMM. On CPU tensors the chunks run in
turn.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

import torch

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir.op import Contract, eval_int
from flashgen.ir.variants import DEQUANT, count, dense_schedule
from flashgen.targets.buffers import kept_buffer
from flashgen.targets.descriptor import Target
from flashgen.targets.kernel import Kernel, Launcher
from flashgen.kernel_classes import kernel_class
from flashgen.workload import Schedule, Workload, dequant_forms

STAGE_OUTPUT = "weight"  # the dequant op's one output


def plan(wl: Workload, schedule: Schedule, target: Target) -> tuple[tuple[Workload, Schedule], tuple[Workload, Schedule]] | None:
    """((the dequant workload, its schedule), (the dense workload, its schedule)) for a schedule that
    dequantizes first, else None. The dequant kernel takes its space's analytic default."""
    if not schedule.get("variant", "").startswith(DEQUANT):
        return None
    forms = dequant_forms(wl, count(schedule, "dequant_chunks"))
    assert forms is not None, f"{wl.op_name} has no dequant form"
    stage, dense = forms
    # the stage's analytic default, from its class's rules through the registry (a backend imports no space)
    stage_schedule = kernel_class(stage.op.kclass).space_rules().default(stage, target)
    return (stage, stage_schedule), (dense, dense_schedule(schedule))


def column_axes(wl: Workload) -> dict[str, int]:
    """Each tensor of the dense op with an N axis (the weight, outputs, bias, residual): that axis,
    where a chunk of the weight's rows takes a slice."""
    n = E.Dim("N")
    return {t.name: t.shape.index(n) for t in wl.inputs + wl.outputs if n in t.shape}


def weight_input(dense: Workload) -> str:
    """The dense op's weight tensor: the one its contraction's W operand loads."""
    [con] = [st for st in dense.op.body(dense.attr) if isinstance(st, Contract)]
    return con.b.tensor


class StagedLauncher:
    """Runs the dequant launcher into a scratch weight (one per device, kept), then the dense one on
    it, chunk by chunk of the weight's rows when the dense kernel was built for a chunk."""

    def __init__(self, stage: tuple[Workload, Launcher], main: tuple[Workload, Launcher]):
        (self.stage_wl, self.stage), (self.main_wl, self.main) = stage, main
        self.stage_inputs = tuple(t.name for t in self.stage_wl.inputs)
        self.weight_name = weight_input(self.main_wl)
        self.main_tensors = tuple(t.name for t in self.main_wl.inputs + self.main_wl.outputs if t.name != self.weight_name)
        self.chunk = self.main_wl.dim["N"]
        self.chunks = self.stage_wl.dim["N"] // self.chunk
        self.columns = column_axes(self.main_wl)
        self._weights: dict[str, torch.Tensor] = {}
        self._streams: dict[str, tuple[torch.cuda.Stream, list[torch.cuda.Event]]] = {}

    def weight(self, device: torch.device) -> torch.Tensor:
        w = self._weights.get(str(device))
        if w is None:
            shape = self.stage_wl.shape(STAGE_OUTPUT)
            w = self._weights[str(device)] = kept_buffer(math.prod(shape), dtypes.TORCH[
                self.stage_wl.tensor_dtype(STAGE_OUTPUT)], device).view(shape)
        return w

    def side_stream(self, device: torch.device) -> tuple[torch.cuda.Stream, list[torch.cuda.Event]]:
        """The device's side stream for the dequant chunks, and an event per chunk (kept: no
        allocation per call, and CUDA-graph capture sees the same objects every time)."""
        key = str(device)
        if key not in self._streams:
            self._streams[key] = (torch.cuda.Stream(device), [torch.cuda.Event() for _ in range(self.chunks)])
        return self._streams[key]

    def __call__(self, tensors: Mapping[str, torch.Tensor], params: Mapping[str, float],
                 dims: Mapping[str, int]) -> None:
        if eval_int(self.main_wl.op.domain[0], dims) == 0:
            return
        device = next(iter(tensors.values())).device
        w = self.weight(device)
        staged = {**{n: tensors[n] for n in self.stage_inputs}, STAGE_OUTPUT: w}
        main = {**{n: tensors[n] for n in self.main_tensors}, self.weight_name: w}
        if self.chunks == 1:
            self.stage(staged, {}, self.stage_wl.dim)
            self.main(main, params, dims)
            return
        c = self.chunk
        dims = {**dims, "N": c}
        for j in range(self.chunks):
            part = {n: v[j * c:(j + 1) * c] for n, v in staged.items()}
            cols = {n: v.narrow(self.columns[n], j * c, c) if n in self.columns else v for n, v in main.items()}
            if device.type != "cuda":
                self.stage(part, {}, {**self.stage_wl.dim, "N": c})
                self.main(cols, params, dims)
                continue
            side, done = self.side_stream(device)
            if j == 0:  # the inputs, and the last call's GEMMs; the quantized weights the side stream
                # reads are the caller's parameters, which outlive the call (no record_stream needed)
                side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self.stage(part, {}, {**self.stage_wl.dim, "N": c})
                done[j].record(side)
            torch.cuda.current_stream(device).wait_event(done[j])
            self.main(cols, params, dims)


def launcher(wl: Workload, schedule: Schedule, target: Target,
             make: Callable[[Workload, Schedule], Launcher]) -> Launcher:
    """`make(wl, schedule)`, or for a schedule that dequantizes first the staged pair of launchers."""
    p = plan(wl, schedule, target)
    if p is None:
        return make(wl, schedule)
    (stage, ss), (dense, ds) = p
    return StagedLauncher((stage, make(stage, ss)), (dense, make(dense, ds)))


def kernel(wl: Workload, schedule: Schedule, target: Target, stage: Kernel, main: Kernel) -> Kernel:
    """One Kernel of the two built parts: the dense GEMM's source and binary, both parts' files."""
    parts = [{"workload": k.workload.to_json(), "schedule": k.schedule, **k.metadata} for k in (stage, main)]
    return Kernel(workload=wl, target=target, schedule=schedule, name=f"{wl.op_name}_staged", source=main.source,
                  asm=main.asm, binary=main.binary, binary_kind=main.binary_kind,
                  metadata={**main.metadata, "parts": parts},
                  launcher=StagedLauncher((stage.workload, stage.launcher), (main.workload, main.launcher)),
                  parts=(stage, main))
