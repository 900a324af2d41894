"""Replaying recorded measurements instead of a GPU, to compare search strategies and cost models.

A table maps schedule keys (`flashgen.db.record.schedule_key`, the key the database uses) to a
latency, or None for a schedule that failed. Measure a space exhaustively once, then replay any
number of strategies and seeds against the table in milliseconds: `replay` drives a strategy alone in
plain batches; `replay_tune` drives the tuner itself (`tuner.tune`, with a Builder and a Runner that
look latencies up in the table), so that its count is what a user pays: the analytic default
measured first, then the tuner's batches. `measurements_to_within` says how many measurements it
took to come within `tol` of the best. Where no sweep covers a space (a GEMM's holds up to 10^5
schedules), `RecordedSpace` is the space cut down to the schedules the records hold: its best is the
best recorded, not the space's.
"""
from __future__ import annotations

import functools
import itertools
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Mapping

import numpy as np

from flashgen.db import Database
from flashgen.db.record import ALONE, schedule_key
from flashgen.schedules.measure import MeasureResult
from flashgen.schedules.search import SearchStrategy
from flashgen.schedules.space import Schedule, ScheduleSpace
from flashgen.schedules.tuner import TuneTask, tune
from flashgen.workload import Workload


def replay(strategy: SearchStrategy, table: Mapping[str, float | None], batch: int = 8,
           budget: int | None = None, strict: bool = True, until: float | None = None) -> list[float | None]:
    """Propose batches of `batch`, "measure" each schedule by looking it up in `table`, observe, until
    the strategy runs dry, `budget` measurements were made, or (with `until`) a batch measured a latency
    <= until. A proposed schedule missing from the table is an error when `strict` (the table does not
    cover the space), else counts as failed."""
    latencies: list[float | None] = []
    while budget is None or len(latencies) < budget:
        if until is not None and any(lat is not None and lat <= until for lat in latencies):
            break
        want = batch if budget is None else min(batch, budget - len(latencies))
        proposed = strategy.propose(want)
        if not proposed:
            break
        results = []
        for s in proposed:
            key = schedule_key(s)
            if strict and key not in table:
                raise KeyError(f"schedule {s} (key {key}) is not in the replay table")
            results.append((s, table.get(key)))
        strategy.observe(results)
        latencies.extend(lat for _, lat in results)
    return latencies


def measurements_to_within(latencies: Iterable[float | None], best: float, tol: float = 0.03) -> int:
    """1-based count of measurements until one is within `tol` of `best`; len(latencies) + 1 if none is."""
    n = 0
    for n, lat in enumerate(latencies, start=1):
        if lat is not None and lat <= best * (1.0 + tol):
            return n
    return n + 1


def table_from_records(records: Iterable) -> dict[str, float | None]:
    """A replay table from database Records of one (workload, target), those timed alone as the tuner
    times: the median of a schedule's ok latencies, None where it never succeeded."""
    lats: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.timing != ALONE:
            continue
        key = r.schedule_key
        lats[key]  # noqa: B018 - a failed-only schedule still gets its entry
        if r.status == "ok" and r.latency_us is not None:
            lats[key].append(r.latency_us)
    return {k: (float(np.median(v)) if v else None) for k, v in lats.items()}


def best_of(table: Mapping[str, float | None]) -> float:
    ok = [v for v in table.values() if v is not None]
    if not ok:
        raise ValueError("the table holds no successful measurement")
    return min(ok)


@dataclass(frozen=True)
class RecordedSpace(ScheduleSpace):
    """A workload's space cut down to `recorded` schedules (and its analytic default, which the tuner
    measures first): valid where the whole space's rules take it and it is one of them. Iterating it,
    sampling it and its size touch only those schedules, never the whole product of the knobs."""
    recorded: tuple[Schedule, ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, space: ScheduleSpace, schedules: Iterable[Schedule]) -> RecordedSpace:
        """`space` cut down to the given schedules that its rules take (completed, each once), and its
        pinned default."""
        default = space.pinned_default()
        keep: dict[str, Schedule] = {}
        for s in itertools.chain([default] if default is not None else [], schedules):
            s = space.complete(s)
            if space.is_valid(s):
                keep.setdefault(schedule_key(s), s)
        return cls(space.workload, space.target, space.fixed, recorded=tuple(keep.values()))

    @functools.cached_property
    def _keys(self) -> frozenset[str]:
        return frozenset(schedule_key(s) for s in self.recorded)

    def why_invalid(self, s: Schedule) -> str | None:
        why = super().why_invalid(s)
        if why is None and schedule_key(self.complete(s)) not in self._keys:
            return "not one of the recorded schedules"
        return why

    def raw_size(self) -> int:
        return len(self.recorded)

    def sample(self, rng: random.Random) -> Schedule:
        return dict(rng.choice(self.recorded))

    def __iter__(self) -> Iterator[Schedule]:
        return (dict(s) for s in self.recorded)

    def default(self) -> Schedule:
        """The whole space's default: the tuner measures it first whether or not a record holds it."""
        return ScheduleSpace(self.workload, self.target).default()


class Found(Exception):
    """Raised by a ReplayRunner after the batch that came within reach: on a GPU the tuner never knows
    the best, so it has no such stop of its own."""


class ReplayBuilder:
    """A Builder for replays: every recorded schedule was built on the GPU's machine."""

    def build(self, wl: Workload, schedules: list[Schedule]) -> list[str | None]:
        return [None] * len(schedules)

    def close(self) -> None:
        pass


class ReplayRunner:
    """A Runner that "measures" a schedule by looking it up in `table` (a missing one is an error: the
    table does not cover the space searched), keeps the latencies in measurement order and each batch's
    size, and raises Found after a batch that measured a latency <= `until`."""
    behind = None  # the records replayed are timed alone

    def __init__(self, space: ScheduleSpace, table: Mapping[str, float | None], until: float | None = None):
        self.space, self.table, self.until = space, table, until
        self.latencies: list[float | None] = []
        self.batches: list[int] = []

    def measure(self, wl: Workload, schedules: list[Schedule], on_result=None) -> list[MeasureResult]:
        out = []
        for s in schedules:
            key = schedule_key(self.space.complete(s))
            if key not in self.table:
                raise KeyError(f"schedule {s} (key {key}) is not in the replay table")
            lat = self.table[key]
            r = (MeasureResult(s, "ok", lat, 0.0) if lat is not None
                 else MeasureResult(s, "crash", error="failed when it was recorded"))
            self.latencies.append(lat)
            if on_result is not None:
                on_result(r)
            out.append(r)
        self.batches.append(len(out))
        if self.until is not None and any(lat is not None and lat <= self.until for lat in self.latencies):
            raise Found
        return out

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _SpaceTask(TuneTask):
    """A TuneTask searching the space given (a RecordedSpace) rather than its workload's whole space."""
    given: ScheduleSpace | None = None

    @property
    def space(self) -> ScheduleSpace:
        return self.given if self.given is not None else super().space


@dataclass
class TunedReplay:
    """One replayed tune: the latency of each measurement in order (None: failed) and each batch's size."""
    latencies: list[float | None]
    batches: list[int]

    def paid_to_within(self, best: float, tol: float = 0.03) -> int:
        """Measurements made up to the end of the batch that first came within `tol` of `best` (the
        tuner stops only between batches); len(latencies) + 1 if none did."""
        n = measurements_to_within(self.latencies, best, tol)
        if n > len(self.latencies):
            return n
        return next(end for end in itertools.accumulate(self.batches) if end >= n)


def replay_tune(space: ScheduleSpace, db: Database, table: Mapping[str, float | None], strategy: str,
                seed: int = 0, until: float | None = None) -> TunedReplay:
    """Runs the tuner (`tuner.tune` with its own batch size and order) on `space` against `table`, until
    a batch measures a latency <= `until` or every schedule of the space was measured. `db` is what
    the tune reads and writes: its records of other workloads train the cost model; it must hold none
    of this workload's, which the tuner would not measure again (a copy per replay)."""
    runner = ReplayRunner(space, table, until)
    task = _SpaceTask(space.workload, space.target, trials=sum(1 for _ in space), strategy=strategy, seed=seed,
                      fixed=space.fixed, given=space)
    try:
        tune(task, db, builder=ReplayBuilder(), runner=runner, device_name="replay")
    except Found:
        pass
    return TunedReplay(runner.latencies, runner.batches)
