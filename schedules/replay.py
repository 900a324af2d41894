"""Replaying recorded measurements instead of a GPU, to compare search strategies and cost models.

A table maps schedule keys (`flashgen.db.record.schedule_key`, the key the database uses) to a
latency, or None for a schedule that failed. Measure a space exhaustively once, then replay any
number of strategies and seeds against the table in milliseconds: `replay` drives a strategy as the
tuner would and returns the latencies in measurement order; `measurements_to_within` says how many
measurements it took to come within `tol` of the exhaustive best.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping

import numpy as np

from flashgen.db.record import ALONE, schedule_key
from flashgen.schedules.search import SearchStrategy


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
