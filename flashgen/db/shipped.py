"""Tuned records that ship with flashgen: a fresh install dispatches tuned kernels on a known GPU.

The package holds, per device, the fastest correct record of every workload measured there (one timed
alone and one timed behind its producer where both exist: what `Database.best` can choose), in
`flashgen/db/shipped/<device>.jsonl`, listed with its sha256 in `MANIFEST.json`. Reads go to the
user's database first: a workload with any correct record there is served from those alone, so a
user's own tune overrides what ships. A shipped file whose bytes do not match the manifest is not
served (one warning). `FLASHGEN_SHIPPED=0` turns the shipped records off, to measure with a user
database alone.

Maintainers rebuild the files from H200 record logs with
`python -m flashgen.db.ship h200 benchmarks/results/h200_gemm_records.jsonl ...`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Callable, Iterable

from flashgen.db.database import MEMORY, Database
from flashgen.db.record import Record, canonical_json
from flashgen.errors import FlashgenError
from flashgen.workload import recorded_workload

SHIPPED_DIR = Path(__file__).with_name("shipped")
MANIFEST = "MANIFEST.json"
ENV = "FLASHGEN_SHIPPED"
ORIGIN = "shipped records"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_verified(folder: Path) -> list[Record]:
    """Every record of the files the manifest lists whose sha256 matches; a mismatch warns once."""
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        files = None
    if not isinstance(files, dict):
        warnings.warn(f"flashgen: {folder / MANIFEST} is missing or unreadable; no shipped records are served",
                      stacklevel=3)
        return []
    records: list[Record] = []
    for name, entry in sorted(files.items()):
        path = folder / Path(name).name  # names stay inside the folder
        try:
            data = path.read_bytes()
            if not isinstance(entry, dict) or _sha256(data) != entry.get("sha256"):
                raise ValueError("its sha256 does not match the manifest")
            records += [Record.from_json(json.loads(line)) for line in data.decode("utf-8").split("\n")
                        if line.strip()]
        except (OSError, ValueError, FlashgenError) as exc:
            warnings.warn(f"flashgen: shipped records {path} not served ({exc})", stacklevel=3)
    return records


@functools.cache
def _shipped(folder: Path) -> Database | None:
    records = _read_verified(folder)
    if not records:
        return None
    db = Database(MEMORY)
    db.add_many(records)
    return db


def shipped_database() -> Database | None:
    """The shipped records as a read-only in-memory Database (built once per process), or None when
    there are none or FLASHGEN_SHIPPED=0."""
    if os.environ.get(ENV, "1") == "0":
        return None
    return _shipped(SHIPPED_DIR)


class TunedRecords:
    """Best-of reads over the user's database, then the shipped records.

    A workload with a usable record in the user's database is served from there; the shipped records
    fill in the rest. Each answer says where it came from (the user database's path, or
    ORIGIN)."""

    def __init__(self, user: Database | None, shipped: Database | None = None, use_shipped: bool = True):
        self.user = user
        self.shipped = (shipped or shipped_database()) if use_shipped else None

    def best(self, workload_key: str, target_key: str,
             usable: Callable[[Record], bool] = lambda rec: True) -> tuple[Record, str] | None:
        """The first record in `Database.best`'s order that `usable` accepts (a schedule still valid in
        today's space): the user's where the user has one, else a shipped one."""
        for db, origin in self._sources():
            rec = db.best(workload_key, target_key, usable)
            if rec is not None:
                return rec, origin
        return None

    def best_all(self, target_key: str | None = None,
                 usable: Callable[[Record], bool] = lambda rec: True) -> list[tuple[Record, str]]:
        """The best record `usable` accepts of every (workload, target) either source has, the user's
        where both do."""
        out: dict[tuple[str, str], tuple[Record, str]] = {}
        for db, origin in self._sources():
            for rec in db.best_all(target_key, usable):
                out.setdefault((rec.workload_key, rec.target_key), (rec, origin))
        return [out[k] for k in sorted(out)]

    def _sources(self) -> list[tuple[Database, str]]:
        return [(db, origin) for db, origin in ((self.user, str(self.user.path) if self.user else ""),
                                                (self.shipped, ORIGIN)) if db is not None]


def select(records: Iterable[Record], current: Callable[[Record], bool] = lambda rec: True) -> list[Record]:
    """What ships of a record log: per (workload, target, timing), the fastest correct record among
    those `current` accepts (their workload and schedule as flashgen defines them today)."""
    best: dict[tuple[str, str, str], Record] = {}
    for rec in records:
        key = (rec.workload_key, rec.target_key, rec.timing)
        if rec.status == "ok" and (key not in best or rec.latency_us < best[key].latency_us) and current(rec):
            best[key] = rec
    return [best[k] for k in sorted(best)]


def is_current(rec: Record) -> bool:
    """Whether a record measured a workload and a schedule that flashgen still defines (a record of an
    older weight layout, or with a knob since removed, would never be served)."""
    from flashgen.schedules.space import ScheduleSpace  # the maintainer's build only: spaces sit above db
    from flashgen.targets.descriptor import get_target

    wl = recorded_workload(rec.workload, rec.workload_key)
    return wl is not None and ScheduleSpace(wl, get_target(rec.target_key)).is_valid(rec.schedule)


def write_shipped(records: Iterable[Record], device: str, folder: Path = SHIPPED_DIR) -> Path:
    """Writes `<device>.jsonl` of the selected records and updates the manifest's sha256 for it."""
    chosen = select(records, is_current)
    path = folder / f"{device}.jsonl"
    data = "".join(canonical_json(r.to_json()) + "\n" for r in chosen).encode("utf-8")
    path.write_bytes(data)
    manifest_path = folder / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"files": {}}
    manifest["files"][path.name] = {"sha256": _sha256(data), "records": len(chosen)}
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path
