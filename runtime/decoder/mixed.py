"""Which mode the mixed mode computes a call in, decided once per layer shape when the decoder loads.

For each layer shape N x K and each row count a call may have (the decode buckets 1, 2, 4, ..., 256 of
runtime/decoder/decode_graphs.py, and prefill's PREFILL_ROWS above them), `ModePlan` estimates each
candidate mode's call, as the decoder makes it (runtime/decoder/linear.py `CallForm`: the norm before
qkv and gate_up, the gate before down, the residual o and down add), from the kernels it launches
(runtime/decoder/calls.py) as dispatch would serve them on the running GPU, and picks the fastest. The estimate comes from the records dispatch would
serve the call with (runtime/serving/dispatch.py `tuned_forms`: the target's records, then another
device's of its architecture; the workload's own form, the other 16-bit dtype's, the plain form's),
only those whose schedules serve that row count in their own regime (`serving`: never a one-row GEMV
record for 16 rows), their latencies interpolated to the call's rows (`latency_at`): a curve of the
best time measured at each row count, so a 16-row tile's record still counts at 64 rows, where
dispatch serves the default instead (`dispatch.bucket_records`), which beat such tiles there; a record of another device is scaled
by the ratio of the two devices' bounds for the workload (an H200's record stands for an H100 call at
the H100's lower bandwidth: unscaled, a mode known only by the other GPU's records looked 1.4x faster
than one measured on the running GPU). A mode with no
such record is not chosen while another mode has one (`pick`): a roofline is a bound no kernel of a
new form is known to approach (the H100's W4A8 `lanes` tiles ran at 0.14-0.62 of theirs, the
W4A16 GEMVs at 0.4-0.9), and a mixed decoder that followed one ran 0.81x its own W4A16 at batch 1
(benchmarks/results/model_quant_load.md). Where no mode is measured, the GEMMs' rooflines on the
target decide (flashgen/roofline.py `contraction_us`: 4-bit weights stream the fewest bytes at small
M, int8 tensor cores run twice the 16-bit rate at large M). Every kernel of a call is counted: a
16-bit mode's norm or gate, an int8 mode's fused norm-and-quantization (rmsnorm_quant) or
dynamic_quant, each at no less than its op's fastest record (`launch_floor`: a decode step's rowwise
kernels cost their launch, which neither their rooflines nor larger-M records show).

A call of rows between two planned counts takes the next planned count up, past the largest the
largest's mode. A mixed linear keeps only the weights of the modes its shape's plan picks at some
row count (`MixedLinear.settle`). `describe` says which mode serves which rows of each shape, and why.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from flashgen.db.shipped import serving_devices
from flashgen.errors import FlashgenError
from flashgen.ir import dtypes
from flashgen.roofline import contraction_us, roofline_us
from flashgen.runtime.decoder.calls import call_workloads
from flashgen.runtime.decoder.linear import PLAIN, CallForm
from flashgen.runtime.serving.buckets import best_records
from flashgen.runtime.serving.dispatch import serving, tuned_forms
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets.descriptor import Target, get_target
from flashgen.workload import Workload

if TYPE_CHECKING:
    from flashgen.runtime.decoder.quant_modes import QuantLinear

PREFILL_ROWS = (512, 1024, 2048, 4096, 8192)  # rows planned above the decode buckets


def planned_rows() -> tuple[int, ...]:
    """The decode buckets (CUDA-graph batch sizes), then PREFILL_ROWS."""
    from flashgen.runtime.decoder.decode_graphs import MAX_BATCH, buckets  # (decode_graphs imports the model)

    return tuple(buckets(MAX_BATCH)) + tuple(r for r in PREFILL_ROWS if r > MAX_BATCH)


def latency_at(measured: Mapping[int, float], m: int, grows: bool = True) -> float:
    """A kernel's latency at M = m from its latencies at measured M: linear between two measured M;
    where it `grows` (a GEMM) flat below the smallest (the weight's read bounds it) and above the
    largest in proportion to M (as if compute-bound: an upper bound, so that a mode measured at the
    call's M is preferred to a guess); else (a rowwise kernel, whose bytes are its rows') in proportion
    to M below the smallest, `estimate` keeping it above what a launch costs (`launch_floor`), and flat above the
    largest (a norm or gate of a few more rows costs its launch again)."""
    ms = sorted(measured)
    if m <= ms[0]:
        return measured[ms[0]] * (1.0 if grows else m / ms[0])
    if m >= ms[-1]:
        return measured[ms[-1]] * (m / ms[-1] if grows else 1.0)
    hi = next(x for x in ms if x >= m)
    lo = max(x for x in ms if x < m)
    return measured[lo] + (measured[hi] - measured[lo]) * (m - lo) / (hi - lo)


ROOFLINE = "roofline"


@dataclass(frozen=True)
class Estimate:
    """A mode's GEMM time at a row count, where it comes from, and the GEMM's roofline."""
    us: float
    source: str  # "records M=1,16, tuned in fp16" or "roofline"
    roofline_us: float

    @property
    def measured(self) -> bool:
        """Whether records, not the roofline alone, give the GEMM's time."""
        return not self.source.startswith(ROOFLINE)


def estimate(wl: Workload, target: Target, db_path: str | os.PathLike | None) -> Estimate:
    """`wl`'s time as dispatch would serve it (`Dispatcher.choose`'s order): a record of exactly its
    rows on any serving device, else the first form (on the first device) holding records that serve
    its rows in their regime, at its rows or more, interpolated to its rows; else the first whose records
    lie below its rows only, extrapolated (an upper bound: a one-row record of the workload's own form
    times 16 is no estimate of 16 rows where another form was measured at 16); else its roofline."""
    space, rows = ScheduleSpace(wl, target), wl.dim[wl.op.row_dims[0]]
    devices = serving_devices(target)
    bound = _bound(wl, target)
    floor = 0.0 if wl.op.kclass == "contraction" else launch_floor(wl, devices, db_path)
    below: Estimate | None = None
    for own_rows_only in (True, False):
        for records in devices:
            for note, tuned in tuned_forms(wl, db_path, records.id, space):
                served: dict[int, float] = {}
                for size, _, rec in serving(tuned, rows, space):
                    if not own_rows_only or (size == rows and not note):
                        served[size] = min(served.get(size, rec.latency_us), rec.latency_us)
                if served:
                    scale, on = 1.0, ""
                    if records is not target:
                        scale = bound / _bound(wl, records)
                        on = f", tuned on {records.id} (x{scale:.2f} for this GPU's bound)"
                    us = latency_at(served, rows, grows=wl.op.kclass == "contraction") * scale
                    us = max(us, floor)
                    found = Estimate(us, f"records M={','.join(map(str, sorted(served)))}{note}{on}", bound)
                    if max(served) >= rows:
                        return found
                    below = below or found
    return below or Estimate(max(bound, floor), ROOFLINE, bound)


def launch_floor(wl: Workload, devices: list[Target], db_path: str | os.PathLike | None) -> float:
    """The fastest record of `wl`'s op at any dims on the serving devices (0 without one): what a launch
    of that kernel costs at the least. A rowwise kernel of a decode step's rows moves a few hundred KB,
    whose roofline (0.1-0.2 us) and a large-M record flattened down to it (13 us for a 512-row silu_mul
    at 16 rows) both missed its 1.7-2.7 us in the step by 10x, each way; the op's one-row records,
    1.4-2.6 us, do not."""
    return min((rec.latency_us for d in devices for rec in best_records(db_path, d.id)
                if rec.workload.get("op") == wl.op_name), default=0.0)


def _bound(wl: Workload, target: Target) -> float:
    """`wl`'s lower bound on `target`: a GEMM's at its operands' matrix rate, another kernel's roofline."""
    return contraction_us(wl, target) if wl.op.kclass == "contraction" else roofline_us(wl, target)


def call_estimate(calls: list[Workload], target: Target, db_path: str | os.PathLike | None) -> Estimate:
    """A call's time: its GEMM's estimate plus those of the kernels before it (an int8 mode's activation
    quantization, an extra launch that W4A16 does not make); known by records where its GEMM is."""
    parts = [estimate(wl, target, db_path) for wl in calls]
    gemm = parts[-1]
    extra = "".join(f" + {wl.op_name} {e.us:.1f} us" for wl, e in zip(calls[:-1], parts[:-1]))
    return Estimate(sum(e.us for e in parts), gemm.source + extra, sum(e.roofline_us for e in parts))


def pick(estimates: tuple[tuple[str, Estimate], ...]) -> str:
    """The fastest mode among those known by records, or among all where none is (rooflines alone)."""
    measured = [(mode, e) for mode, e in estimates if e.measured]
    return min(measured or estimates, key=lambda me: me[1].us)[0]


@dataclass(frozen=True)
class Choice:
    """The mode a call of `rows` rows runs in, and each candidate's estimate that decided it."""
    rows: int
    mode: str
    estimates: tuple[tuple[str, Estimate], ...]


class ModePlan:
    """The mixed mode's chooser: `plan(choices)` decides a layer shape's mode at every planned row count
    from its candidate linears (by mode), once per shape; `plan(n, k, m)` is then the mode of a call."""

    def __init__(self, target: Target | str, db_path: str | os.PathLike | None, dtype: torch.dtype):
        self.target = get_target(target) if isinstance(target, str) else target
        self.db_path = db_path
        # the GEMMs' activation dtype: a float32 decoder (the CPU's) plans as its bf16 twin would run
        self.dtype = dtype if dtypes.of_torch(dtype) in ("bf16", "fp16") else torch.bfloat16
        self.plans: dict[tuple[int, int], tuple[Choice, ...]] = {}

    def plan(self, choices: Mapping[str, QuantLinear], form: CallForm | None = None) -> set[str]:
        """Plans the shape of `choices`' linears (all one shape), called in `form` (None: plain), if not
        yet done; the modes it picks. A shape is planned once, in the form of its first linear: in the
        decoders served, each shape is one linear's (qkv, o, gate_up, down)."""
        shape = next(iter(choices.values())).shape
        if shape not in self.plans:
            out = []
            for rows in planned_rows():
                est = tuple((mode, call_estimate(call_workloads(q, rows, self.dtype, form or PLAIN), self.target,
                                                 self.db_path))
                            for mode, q in choices.items())
                out.append(Choice(rows, pick(est), est))
            self.plans[shape] = tuple(out)
        return {c.mode for c in self.plans[shape]}

    def __call__(self, n: int, k: int, m: int) -> str:
        plan = self.plans.get((n, k))
        if plan is None:
            raise FlashgenError(f"no mixed-mode plan for a {n}x{k} linear: its weights were not settled by this plan")
        return next((c.mode for c in plan if c.rows >= m), plan[-1].mode)

    def describe(self) -> list[str]:
        """One line per planned shape: which mode serves which rows, and the estimates that decided."""
        lines = []
        for (n, k), plan in sorted(self.plans.items()):
            runs: list[list[Choice]] = []
            for c in plan:
                if runs and runs[-1][-1].mode == c.mode:
                    runs[-1].append(c)
                else:
                    runs.append([c])
            parts = []
            for run in runs:
                lo, hi, c = run[0].rows, run[-1].rows, run[0]
                span = f"{lo}" if lo == hi else f"{lo}-{hi}"
                why = ", ".join(f"{mode} {e.us:.1f} us ({e.source})" for mode, e in c.estimates)
                parts.append(f"{c.mode} at rows {span} (at {lo}: {why})")
            lines.append(f"mixed {n}x{k} on {self.target.id}: " + "; ".join(parts))
        return lines
