"""The nearest tuned bucket, and the database's best records read once per database state.

Dispatch (a kernel's schedule for an untuned row count) asks which tuned workload is nearest a call's:
the smallest tuned row count at or above the call's, else the largest below, and among records of that
row count the nearest in the other row dims. The mixed mode's plan (runtime/decoder/mixed.py) reads the
same records for every mode, row count and layer shape, so `best_records` keeps what it read until the
database file changes. The
records come from the user's database first, then from the records shipped with flashgen
(flashgen/db/shipped.py) for workloads the user has not measured.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, TypeVar

from flashgen.db import Database
from flashgen.db.record import Record
from flashgen.db.shipped import TunedRecords, shipped_database
from flashgen.schedules.record_check import unservable

T = TypeVar("T")

_BEST: dict[tuple[str, str, int], tuple[tuple, list[Record]]] = {}  # (db, target, shipped) -> (file state, best_all)


def nearest(tuned: Sequence[tuple[int, float, T]], rows: int) -> tuple[int, T] | None:
    """Of (tuned row count, distance in the other row dims, item) triples, the row count and item of
    the smallest row count >= `rows` (the nearest among those), else of the largest below; None if empty."""
    if not tuned:
        return None
    above = [t for t in tuned if t[0] >= rows]
    size, _, item = (min(above, key=lambda t: t[:2]) if above else max(tuned, key=lambda t: (t[0], -t[1])))
    return size, item


def _state(path: Path) -> tuple:
    """What changes when a writer commits: the file's and its write-ahead log's size and mtime."""
    out = []
    for p in (path, Path(f"{path}-wal")):
        try:
            st = p.stat()
            out.append((st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            out.append(None)
    return tuple(out)


def best_records(db_path: str | os.PathLike | None, target_id: str) -> list[Record]:
    """The best servable record of every workload on `target_id` (a stale top record gives way to the
    workload's next, as in the exact lookup): the user's database at `db_path` (if there is one), then
    the shipped records for workloads it lacks; the database is read again only after its file changed."""
    path = Path(db_path) if db_path is not None else None
    state = _state(path) if path is not None else (None, None)
    shipped = shipped_database()
    key = (str(path.resolve()) if path is not None else "", target_id, id(shipped))
    hit = _BEST.get(key)
    if hit is not None and hit[0] == state:
        return hit[1]
    user = Database(path, readonly=True) if state[0] is not None else None
    try:
        records = [rec for rec, _ in TunedRecords(user, shipped).best_all(target_id, lambda r: unservable(r) is None)]
    finally:
        if user is not None:
            user.close()
    _BEST[key] = (state, records)
    return records
