"""Dispatch: which kernel serves a call, by shape.

For each call the dispatcher binds the op's dims from the tensors (row dims such as M vary per call),
then picks a schedule: the database's best for exactly this workload (`Database.best`: its fastest
record timed behind a producer, as a decode step runs it, where it has any); else the best of the nearest
tuned bucket (the same workload with the smallest tuned row count at or above this one, else the
largest below, and among those the nearest in the other row dims, such as a decode's context
length; failing that, the same in the other 16-bit float dtype, then the workload's plain form: a
fused norm's base GEMM, epilogues left out, which streams the same weights). Each step reads the
call's own device's records, then another device's of the same architecture (an H100 served by H200
records: the schedules are valid there and rank alike, far better than a default): an exact record
of a sibling device comes before a bucket of the call's own, and a record at the call's rows in
another form (on any device) before a record of another row count. Else the analytic default.
A bucket never crosses a kernel regime: a record tuned at another row count whose schedule would not
serve the call's rows as it served its own (`ScheduleSpace.why_not_bucket`: a one-row GEMV tile for
16 rows reads the weight 16 times; a 16-row tile for 64 rows reads it 4 times where the default's tile,
filling the SMs, reads it once) is skipped, in every form and on every device, and where a form's
nearest record was skipped the decision's source says so ("default (bucket M=1 skipped: a GEMV tile
of 1 row cannot serve 16 rows)"), and no record of that form tuned farther from the call's rows serves
in its place. A record tuned at the call's own row count serves it as measured.
Kernels are compiled once per (workload, schedule) and come from the on-disk artifact cache after
that, so a warm start compiles nothing. Every decision is kept
(and logged at DEBUG) for `flashgen explain`.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from flashgen.compiler import check_supported, compile as compile_kernel
from flashgen.db import Database, default_db_path
from flashgen.db.record import BEHIND, Record
from flashgen.db.shipped import ORIGIN, TunedRecords, serving_devices
from flashgen.errors import FlashgenError
from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.oplib import get_op
from flashgen.runtime.serving.buckets import best_records, nearest
from flashgen.schedules.space import Schedule, ScheduleSpace
from flashgen.targets.descriptor import Target, get_target
from flashgen.targets.device import device_target
from flashgen.targets.kernel import MAX_CALL_SIGNATURES, Kernel
from flashgen.workload import Workload, other_half, workload

log = logging.getLogger("flashgen.dispatch")
SKIPPED = " skipped: "  # a decision's note on a bucket record of another regime it passed over


@dataclass(frozen=True)
class Decision:
    workload: Workload
    target: str
    schedule: Schedule
    # "exact", "exact (timed behind OP)", "exact from shipped records", "bucket M=...", "bucket M=..., tuned
    # in fp16", "bucket M=..., tuned as gemm ...", "exact, tuned on cuda:sm_90/h200", "default", each
    # followed by " (bucket M=... skipped: WHY; ...)" where records of another regime were passed over
    source: str

    @property
    def kind(self) -> str:
        """exact, bucket, other-dtype bucket, plain-form bucket, other-device record or default (of the
        record served: the skipped ones' notes do not count)."""
        source = self.source
        if SKIPPED in source:
            source = source[:source.rindex(" (", 0, source.index(SKIPPED))]
        if "tuned on" in source:
            return "other-device record"
        if "tuned in" in source:
            return "other-dtype bucket"
        return "plain-form bucket" if "tuned as" in source else source.split(" ")[0]


def bind_shapes(op_name: str, tensors: Mapping[str, torch.Tensor], given: Mapping[str, int]) -> dict[str, int]:
    """Dims read off tensor shapes: an axis that is a dim, a constant times a dim, or a dim plus a
    constant binds that dim; dims no shape determines must be given."""
    op = get_op(op_name)
    dims = dict(given)
    for t in op.inputs:
        if t.name not in tensors:
            continue
        shape = tensors[t.name].shape
        for axis, e in enumerate(t.shape):
            if axis >= len(shape):
                continue
            n = int(shape[axis])
            if isinstance(e, E.Dim):
                dims.setdefault(e.name, n)
            elif isinstance(e, E.Binary) and e.op == "mul" and isinstance(e.a, E.Const) and isinstance(e.b, E.Dim):
                dims.setdefault(e.b.name, n // int(e.a.value))
            elif isinstance(e, E.Binary) and e.op == "add" and isinstance(e.a, E.Dim) and isinstance(e.b, E.Const):
                dims.setdefault(e.a.name, n - int(e.b.value))
    missing = [d for d in op.dims if d not in dims and d not in op.attr_dims]  # (an attr binds those)
    if missing:
        raise FlashgenError(f"{op_name}: dims {', '.join(missing)} cannot be read off the tensors; pass them")
    return dims


def describe_sources(counts: Mapping[str, int]) -> str:
    """`Dispatcher.sources` as text: "bucket 2, default 1, exact 4"."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def tuned_forms(wl: Workload, db_path: str | os.PathLike | None, records_id: str, space: ScheduleSpace
                ) -> list[tuple[str, list[tuple[int, float, Record]]]]:
    """The forms a bucket of `wl` is looked for in, in order, each as (its note in a decision's source,
    its best records on `records_id` as (row count, distance in the other row dims, record)): the
    workload's own, the other 16-bit float dtype's (", tuned in fp16"), the plain form's (", tuned as
    gemm"); only records of the same fixed dims whose schedules `space` admits."""
    row = wl.op.row_dims[0]
    fixed = {k: v for k, v in wl.dim.items() if k not in wl.op.row_dims}
    plain_op, plain_attrs = wl.op.plain_form(wl.attr)
    forms = [(wl.op_name, wl.attr, "")]
    other = other_half(wl.attr)
    if other:
        forms.append((wl.op_name, other, f", tuned in {other['dtype']}"))
    if (plain_op, plain_attrs) != (wl.op_name, wl.attr):
        changed = " ".join(f"{a}={v}" for a, v in sorted(plain_attrs.items()) if wl.attr.get(a) != v)
        forms.append((plain_op, plain_attrs, f", tuned as {plain_op}" + (f" {changed}" if changed else "")))
    ops = {f[0] for f in forms}
    best = [rec for rec in best_records(db_path, records_id) if rec.workload.get("op") in ops and
            all(rec.workload["dims"].get(k) == v for k, v in fixed.items()) and space.is_valid(rec.schedule)]
    return [(note, [(rec.workload["dims"][row], _distance(rec.workload["dims"], wl), rec) for rec in best
                    if rec.workload.get("op") == op_name and rec.workload.get("attrs") == attrs])
            for op_name, attrs, note in forms]


def serving(tuned: list[tuple[int, float, Record]], rows: int, space: ScheduleSpace) -> list[tuple[int, float, Record]]:
    """Of (tuned row count, distance, record) triples, those whose schedules serve a call of `rows` rows
    in their own regime: tuned at those rows (measured there), or in the regime of `space`'s workload
    (`ScheduleSpace.why_other_regime`)."""
    return [t for t in tuned if t[0] == rows or space.why_other_regime(t[2].schedule) is None]


def bucket_records(tuned: list[tuple[int, float, Record]], rows: int, space: ScheduleSpace) -> list[tuple[int, float, Record]]:
    """Those of `serving`'s triples that dispatch serves a call of `rows` rows as a bucket: also leaving
    out tiles that would read the weight more often than the default's (`ScheduleSpace.why_not_bucket`)."""
    return [t for t in tuned if t[0] == rows or space.why_not_bucket(t[2].schedule) is None]


def _notes(skipped: list[str]) -> str:
    """The records of another regime a decision passed over, as the end of its source ("" if none)."""
    return f" ({'; '.join(skipped)})" if skipped else ""


def _distance(dims: Mapping[str, int], wl: Workload) -> float:
    """How far a record's other row dims are from the call's, as summed |log2| ratios: between records
    of one bucket size, the nearest wins (a decode schedule tuned for a 4k context, not a 128k one).
    Dims that size a buffer, not the work (`Op.capacity_dims`), do not count."""
    return sum(abs(math.log2(max(1, dims.get(d, 1)) / max(1, wl.dim[d]))) for d in wl.op.row_dims[1:]
               if d not in wl.op.capacity_dims)


def _farther(size: int, than: int, rows: int) -> bool:
    """Whether row count `size` lies farther from `rows` than `than` does (as a ratio)."""
    return abs(math.log2(size / rows)) > abs(math.log2(than / rows))


def _tuned_on(records: Target, target: Target) -> str:
    """A source's note naming the sibling device whose records served the call, if not the call's own."""
    return "" if records is target else f", tuned on {records.id}"


class Dispatcher:
    def __init__(self, target: Target | str | None = None, db: str | os.PathLike | None = None):
        self._target = get_target(target) if isinstance(target, str) else target
        self.db_path = Path(db) if db is not None else default_db_path()
        self.kernels: dict[tuple[str, str], Kernel] = {}
        self.decisions: dict[str, Decision] = {}
        self._calls: dict[tuple, Kernel] = {}  # call signature -> kernel: a repeated call skips all the rest

    def target_for(self, device: torch.device) -> Target:
        if self._target is not None:
            return self._target
        return device_target(device)

    def workload_for(self, op_name: str, tensors: Mapping[str, torch.Tensor], attrs: Mapping[str, str],
                     dims: Mapping[str, int] | None = None) -> Workload:
        first = next(iter(tensors.values()))
        attrs = {"dtype": dtypes.of_torch(first.dtype), **attrs} if "dtype" in get_op(op_name).attrs else dict(attrs)
        # (an explicit dtype attr wins: int8 and fp8 GEMMs name their output dtype)
        return workload(op_name, **bind_shapes(op_name, tensors, dims or {}), **attrs)

    def choose(self, wl: Workload, target: Target) -> Decision:
        space = ScheduleSpace(wl, target)
        skipped: list[str] = []  # buckets of another regime passed over, said in the decision
        devices = serving_devices(target)
        # every device's exact record first, then every device's nearest bucket: a record of this very
        # workload from a sibling GPU ranks its schedules alike, a bucket of another row count may not
        for records in devices:
            found = self._exact(wl, records.id, space)
            if found is not None:
                return Decision(wl, target.id, found[1], found[0] + _tuned_on(records, target))
        # then a record at the call's own rows in another form (the other dtype's, the plain form's) on
        # any device, before a record of another row count: on the H100, its own 64-row record of the
        # bf16 down projection (a 32-row tile) served 256 rows ahead of the H200's 256-row plain-form
        # record, and bf16 decoded 0.84x as fast at batch 256 (docs/findings.md)
        for records in devices:
            found = self._bucket(wl, records.id, space, _tuned_on(records, target), [], same_rows=True)
            if found is not None:
                return Decision(wl, target.id, found[1], found[0] + _tuned_on(records, target))
        for records in devices:
            found = self._bucket(wl, records.id, space, _tuned_on(records, target), skipped)
            if found is not None:
                source, schedule = found
                return Decision(wl, target.id, schedule, source + _tuned_on(records, target) + _notes(skipped))
        return Decision(wl, target.id, space.default(), "default" + _notes(skipped))

    def _exact(self, wl: Workload, records_id: str, space: ScheduleSpace) -> tuple[str, Schedule] | None:
        """The best valid record of exactly `wl` among `records_id`'s (the user's database, then the
        shipped records), as (source, schedule)."""
        user = Database(self.db_path, readonly=True) if self.db_path.exists() else None
        try:
            found = TunedRecords(user).best(wl.key, records_id, lambda rec: space.is_valid(rec.schedule))
        finally:
            if user is not None:
                user.close()
        if found is None:
            return None
        best, origin = found
        timed = f" (timed behind {best.extra['behind']['op']})" if best.timing == BEHIND else ""
        return "exact" + timed + (" from shipped records" if origin == ORIGIN else ""), best.schedule

    def _bucket(self, wl: Workload, records_id: str, space: ScheduleSpace, tuned_on: str,
                skipped: list[str], same_rows: bool = False) -> tuple[str, Schedule] | None:
        """The nearest tuned workload differing only in row dims (`buckets.nearest`): M rounded up, else
        the largest below.
        Failing that, the same in the other 16-bit float dtype (fp16 and bf16 kernels of one schedule
        run alike: a schedule tuned in one serves the other), then in the workload's plain form
        (`Op.plain_form`: the same weights streamed, without the fused norm or epilogue). Records that
        should not serve the call's rows (`bucket_records`) are left out of each; where a form's nearest
        record was, its note goes to `skipped`, and a record of that form tuned farther from the call's
        rows does not serve either (a 4096-row prefill tile for 128 rows, where the 256-row record was
        skipped). `same_rows`: only records tuned at the call's own rows (in another form)."""
        row = wl.op.row_dims[0]
        rows = wl.dim[row]
        for note, tuned in tuned_forms(wl, self.db_path, records_id, space):
            if same_rows:
                tuned = [t for t in tuned if t[0] == rows]
            pick = nearest(bucket_records(tuned, rows, space), rows)
            near = nearest(tuned, rows)
            if near is not None and (pick is None or near[1] is not pick[1]):
                why = space.why_not_bucket(near[1].schedule)
                skipped.append(f"bucket {row}={near[0]}{note}{tuned_on}{SKIPPED}{why}")
                if pick is not None and _farther(pick[0], near[0], rows):
                    continue
            if pick is not None:
                size, rec = pick
                return f"bucket {row}={size}{note}", rec.schedule
        return None

    def sources(self, kclass: str, rows: int | None = None) -> dict[str, int]:
        """How many of the workloads dispatched so far (of a kernel class, and with this row count if
        given) ran an exact record, a tuned bucket, a bucket tuned in the other dtype, or the default:
        a benchmark says with it whether its kernels were tuned."""
        out: dict[str, int] = {}
        for d in self.decisions.values():
            wl = d.workload
            if wl.op.kclass != kclass or (rows is not None and wl.dim[wl.op.row_dims[0]] != rows):
                continue
            out[d.kind] = out.get(d.kind, 0) + 1
        return out

    def kernel(self, op_name: str, tensors: Mapping[str, torch.Tensor], attrs: Mapping[str, str] | None = None,
               dims: Mapping[str, int] | None = None) -> Kernel:
        signature = (op_name, tuple((n, t.shape, t.dtype, t.device) for n, t in tensors.items()),
                     tuple(sorted((attrs or {}).items())), tuple(sorted((dims or {}).items())))
        hit = self._calls.get(signature)
        if hit is not None:
            return hit
        kernel = self._kernel(op_name, tensors, attrs, dims)
        if len(self._calls) >= MAX_CALL_SIGNATURES:
            self._calls.clear()
        self._calls[signature] = kernel
        return kernel

    def _kernel(self, op_name: str, tensors: Mapping[str, torch.Tensor], attrs: Mapping[str, str] | None,
                dims: Mapping[str, int] | None) -> Kernel:
        device = next(iter(tensors.values())).device
        target = self.target_for(device)
        wl = self.workload_for(op_name, tensors, attrs or {}, dims)
        check_supported(wl, target)  # (before a schedule is chosen: one line naming what the target lacks)
        decision = self.decisions.get(wl.key + target.id)
        if decision is None:
            decision = self.choose(wl, target)
            self.decisions[wl.key + target.id] = decision
            log.debug("%s on %s: schedule %s (%s)", wl, target.id, decision.schedule, decision.source)
        fixed = {k: v for k, v in wl.dim.items() if k not in wl.op.row_dims}
        key = (json.dumps([target.id, wl.op_name, fixed, wl.attr], sort_keys=True),
               json.dumps(decision.schedule, sort_keys=True))  # row dims vary per call: one kernel serves all
        if key not in self.kernels:
            self.kernels[key] = compile_kernel(wl, target, schedule=decision.schedule)
        return self.kernels[key]
