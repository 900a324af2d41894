"""The nearest tuned bucket, and the database's best records read once per database state.

Both dispatch (a kernel's schedule for an untuned row count) and mixed-mode linears (w4a16 or w8a8 for
a row count) ask which tuned workload is nearest a call's: the smallest tuned row count at or above the
call's, else the largest below, and among records of that row count the nearest in the other row dims.
Linears ask on every call, so `best_records` keeps what it read until the database file changes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence, TypeVar

from flashgen.db import Database
from flashgen.db.record import Record

T = TypeVar("T")

_BEST: dict[tuple[str, str], tuple[tuple, list[Record]]] = {}  # (db, target) -> (file state, best_all)


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


def best_records(db_path: str | os.PathLike, target_id: str) -> list[Record]:
    """`Database.best_all(target_id)` of the database at `db_path` (none if it does not exist), read
    again only after the file changed."""
    path = Path(db_path)
    state = _state(path)
    if state[0] is None:
        return []
    key = (str(path.resolve()), target_id)
    hit = _BEST.get(key)
    if hit is not None and hit[0] == state:
        return hit[1]
    with Database(path) as db:
        records = db.best_all(target_id)
    _BEST[key] = (_state(path), records)
    return records
