"""Tuned records that ship with flashgen: a fresh install dispatches tuned kernels on a known GPU.

The package holds, per device, the fastest correct record of every workload measured there (one timed
alone and one timed behind its producer where both exist: what `Database.best` can choose), in
`flashgen/db/shipped/<device>.jsonl`, listed with its sha256 in `MANIFEST.json`. Reads go to the
user's database first: a workload with any correct record there is served from those alone, so a
user's own tune overrides what ships. A shipped file whose bytes do not match the manifest is not
served, nor a record whose workload is not the one its key names (one warning each).
`FLASHGEN_SHIPPED=0` (or false, no, off) turns the shipped records off, to measure with a user database
alone; a value that is no such word is refused.

Maintainers rebuild a device's file from its record logs with
`python -m flashgen.db.ship h200 benchmarks/results/h200_gemm_records.jsonl ...` (h100 likewise); a rebuild
whose logs miss a workload the file ships now is refused unless `--drop` says so.
"""
from __future__ import annotations

import functools
import hashlib
import json
import warnings
from pathlib import Path
from typing import Callable, Iterable

from flashgen.db.database import MEMORY, Database
from flashgen.db.record import Record, canonical_json
from flashgen.env import switch
from flashgen.errors import FlashgenError
from flashgen.targets.descriptor import Target, siblings
from flashgen.workload import recorded_workload

SHIPPED_DIR = Path(__file__).with_name("shipped")
MANIFEST = "MANIFEST.json"
ENV = "FLASHGEN_SHIPPED"
ORIGIN = "shipped records"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_verified(folder: Path) -> tuple[list[Record], list[str]]:
    """Every record of the files the manifest lists whose sha256 matches, less those whose workload is
    not the one their key names (a key is how dispatch finds a record: such a record would serve its
    schedule to another workload as exact); and why anything was left out."""
    try:
        files = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        files = None
    if not isinstance(files, dict):
        return [], [f"{folder / MANIFEST} is missing or unreadable"]
    records: list[Record] = []
    problems: list[str] = []
    for name, entry in sorted(files.items()):
        path = folder / Path(name).name  # names stay inside the folder
        try:
            data = path.read_bytes()
        except OSError as exc:
            problems.append(f"{path} cannot be read ({exc.strerror or exc})")
            continue
        if not isinstance(entry, dict) or _sha256(data) != entry.get("sha256"):
            problems.append(f"{path} failed its sha256 check against {MANIFEST} (changed since flashgen was "
                            "installed; reinstall flashgen)")
            continue
        try:
            found = [Record.from_json(json.loads(line)) for line in data.decode("utf-8").split("\n") if line.strip()]
        except (ValueError, FlashgenError) as exc:
            problems.append(f"{path} does not parse ({exc})")
            continue
        keyed: list[Record] = []
        stray: list[Record] = []
        for rec in found:
            (keyed if recorded_workload(rec.workload, rec.workload_key) is not None else stray).append(rec)
        if stray:
            problems.append(f"{path}: {len(stray)} records whose workload is not the one their key names (the "
                            f"first: {stray[0].workload_key})")
        records += keyed
    return records, problems


@functools.cache
def _load(folder: Path) -> tuple[Database | None, tuple[str, ...]]:
    records, problems = _read_verified(folder)
    if not records:
        return None, tuple(problems)
    db = Database(MEMORY)
    db.add_many(records)
    return db, tuple(problems)


def shipped_on() -> bool:
    """Whether FLASHGEN_SHIPPED leaves the shipped records on (its usual words; another value is refused)."""
    return switch(ENV)


def shipped_records() -> tuple[Database | None, tuple[str, ...]]:
    """The shipped records as a read-only in-memory Database (built once per process; None when none
    are served or FLASHGEN_SHIPPED turns them off), and why a file or record of them is not served."""
    return _load(SHIPPED_DIR) if shipped_on() else (None, ())


@functools.cache
def _warn(problem: str) -> None:
    """Each problem once per process: dispatch asks for the shipped records on every new workload."""
    warnings.warn(f"flashgen: shipped records not served: {problem}", stacklevel=4)


def shipped_database() -> Database | None:
    """`shipped_records`' Database, warning once of what is not served."""
    db, problems = shipped_records()
    for problem in problems:
        _warn(problem)
    return db


class TunedRecords:
    """Best-of reads over the user's database, then the shipped records.

    A workload with a usable record in the user's database is served from there; the shipped records
    fill in the rest. Each answer says where it came from (the user database's path, or ORIGIN).
    `served` and `served_all` add the other devices of a target's architecture after it: the records
    compile and `db best` take (dispatch takes tuned buckets of each device before the next)."""

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

    def served(self, workload_key: str, target: Target,
               usable: Callable[[Record], bool] = lambda rec: True) -> tuple[Record, str] | None:
        """`best` on `target`, else on each other device of its architecture (an H100 takes the H200's:
        the same binaries run there and the schedules are valid); the record's target_key says which."""
        for device in serving_devices(target):
            found = self.best(workload_key, device.id, usable)
            if found is not None:
                return found
        return None

    def served_all(self, target: Target, usable: Callable[[Record], bool] = lambda rec: True) -> list[tuple[Record, str]]:
        """`served` of every workload any device of `target`'s architecture has a record of, by key."""
        out: dict[str, tuple[Record, str]] = {}
        for device in serving_devices(target):
            for rec, origin in self.best_all(device.id, usable):
                out.setdefault(rec.workload_key, (rec, origin))
        return [out[k] for k in sorted(out)]

    def _sources(self) -> list[tuple[Database, str]]:
        return [(db, origin) for db, origin in ((self.user, str(self.user.path) if self.user else ""),
                                                (self.shipped, ORIGIN)) if db is not None]


def serving_devices(target: Target) -> list[Target]:
    """The devices whose records serve `target`, in order: its own, then its architecture's others (the
    one order compile, dispatch, explain and `db best` read records in)."""
    return [target, *siblings(target)]


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


def _shipped_keys(path: Path) -> set[tuple[str, str, str]]:
    """The (workload, target, timing) keys a shipped file holds now (none where there is no file)."""
    if not path.exists():
        return set()
    lines = path.read_text(encoding="utf-8").splitlines()
    recs = [Record.from_json(json.loads(line)) for line in lines if line.strip()]
    return {(r.workload_key, r.target_key, r.timing) for r in recs}


def write_shipped(records: Iterable[Record], device: str, folder: Path = SHIPPED_DIR, drop: bool = False) -> Path:
    """Writes `<device>.jsonl` of the selected records and updates the manifest's sha256 for it.

    A rebuild from logs that miss a record the file ships now would silently take a tuned schedule
    from users; it is refused, naming what would go, unless `drop` says so on purpose."""
    chosen = select(records, is_current)
    path = folder / f"{device}.jsonl"
    lost = _shipped_keys(path) - {(r.workload_key, r.target_key, r.timing) for r in chosen}
    if lost and not drop:
        names = ", ".join(f"{w} ({t}, {timing})" for w, t, timing in sorted(lost)[:5])
        raise FlashgenError(f"{path.name}: the records given hold nothing for {len(lost)} workload(s) it ships now "
                            f"({names}{', ...' if len(lost) > 5 else ''}); add the file itself or their logs to "
                            "the inputs, or pass --drop to remove them")
    data = "".join(canonical_json(r.to_json()) + "\n" for r in chosen).encode("utf-8")
    path.write_bytes(data)
    manifest_path = folder / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {"files": {}}
    manifest["files"][path.name] = {"sha256": _sha256(data), "records": len(chosen)}
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path
