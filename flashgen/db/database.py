"""The tuning log: an append-only SQLite file that concurrent tuners share without losing records."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from flashgen.db.record import ALONE, BEHIND, STATUSES, Record, canonical_json
from flashgen.errors import FlashgenError, reason
from flashgen.paths import cache_dir

FORMAT = "flashgen-tuning-db"
Usable = Callable[[Record], bool]  # whether a best-of read may answer with a record
MEMORY = ":memory:"  # a path that opens a private in-memory database (the shipped records' reader)
SCHEMA_VERSION = 1
_BUSY_TIMEOUT_S = 60.0
_SQLITE_MAGIC = b"SQLite format 3\x00"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS records (
    id INTEGER PRIMARY KEY,
    workload_key TEXT NOT NULL,
    workload_json TEXT NOT NULL,
    target_key TEXT NOT NULL,
    schedule_key TEXT NOT NULL,
    schedule_json TEXT NOT NULL,
    status TEXT NOT NULL,
    latency_us REAL,
    spread_us REAL,
    flashgen_version TEXT NOT NULL,
    device TEXT NOT NULL,
    created_at TEXT NOT NULL,
    extra_json TEXT NOT NULL,
    content_hash TEXT UNIQUE NOT NULL
);
CREATE INDEX IF NOT EXISTS records_workload_target ON records (workload_key, target_key);
"""

# Schedules a running tune is measuring, so that a second tune of the workload measures others. Not
# part of the records' schema: a database without the table is read as having no claims.
_CLAIMS = """CREATE TABLE IF NOT EXISTS claims (
    workload_key TEXT NOT NULL, target_key TEXT NOT NULL, context TEXT NOT NULL, schedule_key TEXT NOT NULL,
    owner TEXT NOT NULL, claimed_at REAL NOT NULL,
    PRIMARY KEY (workload_key, target_key, context, schedule_key))"""
CLAIM_TTL_S = 3600.0  # a claim of another host's tune older than this is taken over


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _claim_alive(owner: str, claimed_at: float) -> bool:
    """Whether a claim's tune may still be measuring: its process runs (this host), or it is recent."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return time.time() - claimed_at < CLAIM_TTL_S
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_COLUMNS = ("id, workload_key, workload_json, target_key, schedule_json, status, latency_us, spread_us, "
            "flashgen_version, device, created_at, extra_json, content_hash")
# Records timed behind a producer first (`Record.timing`), then by latency: one timing's latencies only
# ever compete with each other.
_PREFERRED = (f"IFNULL(json_extract(extra_json, '$.timing'), '{ALONE}') = '{BEHIND}' DESC, latency_us, id")
_INSERT = ("INSERT OR IGNORE INTO records (workload_key, workload_json, target_key, schedule_key, "
           "schedule_json, status, latency_us, spread_us, flashgen_version, device, created_at, "
           "extra_json, content_hash) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")


def default_db_path() -> Path:
    """$FLASHGEN_DB, else the XDG cache dir: tuning results are re-creatable, but costly."""
    if os.environ.get("FLASHGEN_DB"):
        return Path(os.environ["FLASHGEN_DB"]).expanduser()
    return cache_dir().expanduser() / "tuning.db"


def _not_ours(path: Path, why: str) -> FlashgenError:
    return FlashgenError(f"{path} is not a flashgen tuning database ({why}); pass another --db path.")


def _read_meta(conn: sqlite3.Connection) -> dict[str, str] | None:
    """The meta table (with `tables`: the file's table names), None when there is none;
    sqlite3.DatabaseError when the file is not SQLite."""
    tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "meta" not in tables:
        return None
    return {**dict(conn.execute("SELECT key, value FROM meta")), "tables": ",".join(sorted(tables))}


def _check_meta(meta: dict[str, str] | None, path: Path) -> None:
    """Refuse files that are not ours (or are from a newer schema) before anything writes to them."""
    if meta is None:
        raise _not_ours(path, "no flashgen meta table")
    if meta.get("format") != FORMAT:
        raise _not_ours(path, f"format is {meta.get('format')!r}")
    if "records" not in meta.get("tables", "records").split(","):
        raise _not_ours(path, "it has flashgen's meta table but no records table")
    try:
        version = int(meta.get("schema_version", ""))
    except ValueError:
        raise _not_ours(path, f"schema_version is {meta.get('schema_version')!r}") from None
    if version < 1:
        raise _not_ours(path, f"schema_version is {version}")
    if version > SCHEMA_VERSION:
        raise FlashgenError(f"{path} was written by a newer flashgen (schema v{version}, this one "
                            f"reads up to v{SCHEMA_VERSION}); upgrade flashgen or pass another --db path.")


def _validate_existing(path: Path) -> str:
    """Read-only look at an existing file, so a foreign file is never modified; returns the URI mode
    that read it (for a read-only Database)."""
    with open(path, "rb") as f:
        header = f.read(100)
    if not header.startswith(_SQLITE_MAGIC):
        raise _not_ours(path, "not an SQLite file")
    # Even a read-only reader of a WAL-mode file creates -wal and -shm files beside it. With no -wal
    # there, no one has it open, so it is read as immutable, which creates nothing; if a writer
    # checkpointed under that read, the second, ordinary read-only pass sees the true state.
    idle_wal = header[18:19] == b"\x02" and not Path(f"{path}-wal").exists()
    modes = ("immutable=1", "mode=ro") if idle_wal else ("mode=ro",)
    for mode in modes:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?{mode}", uri=True, timeout=_BUSY_TIMEOUT_S)
        try:
            meta = _read_meta(conn)
            break
        except sqlite3.DatabaseError as exc:
            error = exc
        finally:
            conn.close()
    else:
        raise _not_ours(path, f"sqlite: {error}")
    _check_meta(meta, path)
    return mode


def _row_to_record(row: tuple) -> Record:
    """A row of `_COLUMNS` as a Record, which checks every field as it does a new one, and whose content
    must still hash to the hash written with it: a row edited in place (a latency made smaller, a
    schedule changed) is refused rather than served."""
    (_, workload_key, workload_json, target_key, schedule_json, status, latency_us, spread_us,
     flashgen_version, device, created_at, extra_json, content_hash) = row
    record = Record(workload_key=workload_key, workload=json.loads(workload_json), target_key=target_key,
                    schedule=json.loads(schedule_json), status=status, latency_us=latency_us,
                    spread_us=spread_us, flashgen_version=flashgen_version, device=device,
                    created_at=created_at, extra=json.loads(extra_json))
    if record.content_hash != content_hash:
        raise FlashgenError("its fields no longer hash to the content hash written with them: changed since")
    return record


def _records(rows: Iterable[tuple], path: Path, warn: bool = True) -> list[Record]:
    """The rows that are still valid Records. The others (changed or damaged since they were written:
    JSON that does not parse, a latency below 0, NaN or none for an ok record, ...) are never served:
    they are skipped with one warning naming the first and why, so the rest of a damaged database can
    still be listed, exported and served."""
    out, bad = [], []
    for row in rows:
        try:
            out.append(_row_to_record(row))
        except (ValueError, TypeError, RecursionError, FlashgenError) as exc:
            bad.append((row[0], exc))
    if bad and warn:
        row_id, exc = bad[0]
        warnings.warn(f"flashgen: {path}: skipped {len(bad)} stored record(s) that no longer parse or are damaged, "
                      f"never served (the first, row id {row_id}: {reason(exc)})", stacklevel=3)
    return out


def _record_to_row(record: Record) -> tuple:
    return (record.workload_key, canonical_json(record.workload), record.target_key,
            record.schedule_key, canonical_json(record.schedule), record.status, record.latency_us,
            record.spread_us, record.flashgen_version, record.device, record.created_at,
            canonical_json(record.extra), record.content_hash)


class Database:
    """Append-only store of Records; every write is one IMMEDIATE transaction, so writers queue."""

    def __init__(self, path: str | os.PathLike | None = None, readonly: bool = False) -> None:
        """`readonly`: for reading an existing database (list, best, export, compile, dispatch): it is
        never created or written, so a database in a read-only folder can still be read."""
        self.readonly = readonly
        if path == MEMORY:
            self.path = Path(MEMORY)
            # (any thread may read it: the shipped records' reader is built once per process, and a
            # server's engine thread dispatches with it after the main thread did; sqlite serializes)
            self._conn = sqlite3.connect(MEMORY, isolation_level=None, check_same_thread=False)
            self._create_schema()
            return
        self.path = Path(path).expanduser() if path is not None else default_db_path()
        if self.path.is_dir():
            raise FlashgenError(f"{self.path} is a directory; pass a file path with --db.")
        is_new = not self.path.exists() or self.path.stat().st_size == 0
        if readonly:
            if is_new:
                raise FlashgenError(f"no tuning database at {self.path}; tune first, or pass another --db path.")
            mode = _validate_existing(self.path)
            self._conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?{mode}", uri=True,
                                         timeout=_BUSY_TIMEOUT_S, isolation_level=None)
            return
        if not is_new:
            _validate_existing(self.path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # isolation_level=None: we issue BEGIN/COMMIT ourselves; timeout sets busy_timeout.
            self._conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise FlashgenError(f"cannot open tuning database {self.path} ({exc}); "
                                "check the path and its permissions.") from None
        if is_new:  # an existing database is left as is, so a read-only one can still be queried
            try:
                self._create_schema()
            except sqlite3.Error as exc:
                self._conn.close()
                raise FlashgenError(f"cannot create tuning database {self.path} ({exc}); "
                                    "check the path and its permissions.") from None
            except BaseException:
                self._conn.close()
                raise

    def _create_schema(self) -> None:
        """Idempotent, so tuners that create the same new file at once all succeed."""
        with self._write() as conn:  # executescript would commit early, so one by one
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?)", (FORMAT,))
            conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                         (str(SCHEMA_VERSION),))
            _check_meta(_read_meta(conn), self.path)  # another file may have appeared meanwhile
        # WAL lets readers run while a tuner writes; the mode is stored in the file. Switching takes
        # an exclusive lock that SQLite does not wait for, so racing creators retry here.
        deadline = time.monotonic() + _BUSY_TIMEOUT_S
        while True:
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """IMMEDIATE takes the write lock up front, so concurrent writers wait instead of failing."""
        if self.readonly:
            raise FlashgenError(f"{self.path} was opened for reading only")
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                if self._conn.in_transaction:  # SQLite may already have rolled back (e.g. disk full)
                    self._conn.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as exc:
            raise FlashgenError(f"cannot write to tuning database {self.path} ({exc}); "
                                "check its permissions and free space, or pass another --db path.") \
                from None

    def add(self, record: Record) -> bool:
        """False when the identical record is already stored."""
        return self.add_many([record]) == 1

    def add_many(self, records: Iterable[Record]) -> int:
        """All or nothing; returns how many records were new."""
        rows = [_record_to_row(r) for r in records]
        with self._write() as conn:
            before = conn.total_changes
            conn.executemany(_INSERT, rows)
            return conn.total_changes - before

    def claim(self, workload_key: str, target_key: str, context: str, schedule_keys: Iterable[str]) -> set[str]:
        """Of these schedules, the ones this process may measure now: those no other live tune has
        claimed (in this timing context), which are then claimed for this process in one transaction."""
        me, granted = _owner(), set()
        with self._write() as conn:
            conn.execute(_CLAIMS)
            for key in schedule_keys:
                row = conn.execute("SELECT owner, claimed_at FROM claims WHERE workload_key = ? AND target_key = ? "
                                   "AND context = ? AND schedule_key = ?",
                                   (workload_key, target_key, context, key)).fetchone()
                if row is not None and row[0] != me and _claim_alive(*row):
                    continue
                conn.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?, ?, ?)",
                             (workload_key, target_key, context, key, me, time.time()))
                granted.add(key)
        return granted

    def release(self, workload_key: str, target_key: str, context: str) -> None:
        """Drops this process's claims on the workload (its tune ended: what it measured is recorded)."""
        with self._write() as conn:
            conn.execute(_CLAIMS)
            conn.execute("DELETE FROM claims WHERE workload_key = ? AND target_key = ? AND context = ? AND owner = ?",
                         (workload_key, target_key, context, _owner()))

    def records(self, workload_key: str | None = None, target_key: str | None = None,
                status: str | None = None) -> list[Record]:
        """Matching records in insertion order."""
        if status is not None and status not in STATUSES:
            raise FlashgenError(f"unknown status {status!r}; use one of {', '.join(STATUSES)}.")
        where, params = [], []
        for column, value in (("workload_key", workload_key), ("target_key", target_key),
                              ("status", status)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        rows = self._conn.execute(f"SELECT {_COLUMNS} FROM records{clause} ORDER BY id", params)
        return _records(rows, self.path)

    def count(self) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]

    def best(self, workload_key: str, target_key: str, usable: Usable = lambda rec: True) -> Record | None:
        """The fastest correct record, of those timed behind a producer where the workload has any (it
        was tuned for the place it runs in), else of those timed alone; ties go to the earliest. Of
        those, the first `usable` accepts: dispatch passes over schedules today's space refuses."""
        return next((rec for rec in self.ranked(workload_key, target_key) if usable(rec)), None)

    def ranked(self, workload_key: str, target_key: str) -> list[Record]:
        """Every correct record of the workload in `best`'s order, so a caller can serve the first whose
        schedule is still valid."""
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM records WHERE workload_key = ? AND target_key = ? "
            f"AND status = 'ok' ORDER BY {_PREFERRED}", (workload_key, target_key))
        return _records(rows, self.path)

    def best_all(self, target_key: str | None = None, usable: Usable = lambda rec: True) -> list[Record]:
        """`best` of every (workload_key, target_key), sorted by those keys. Where a pair's first row is
        damaged or not `usable`, `best` answers for it (skipping that row, a damaged one with its warning):
        one bad row never hides the workload's other records."""
        clause, params = ("AND target_key = ?", (target_key,)) if target_key is not None else ("", ())
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM (SELECT *, ROW_NUMBER() OVER (PARTITION BY workload_key, "
            f"target_key ORDER BY {_PREFERRED}) AS place FROM records WHERE status = 'ok' "
            f"{clause}) WHERE place = 1 ORDER BY workload_key, target_key", params).fetchall()
        best = {(r.workload_key, r.target_key): r for r in _records(rows, self.path, warn=False) if usable(r)}
        for row in rows:
            pair = (row[1], row[3])
            if pair not in best and (rec := self.best(*pair, usable)) is not None:
                best[pair] = rec
        return [best[pair] for pair in sorted(best)]

    def measured_schedule_keys(self, workload_key: str, target_key: str) -> set[str]:
        """Schedules already tried, whatever the outcome: a crash is not worth repeating."""
        rows = self._conn.execute("SELECT DISTINCT schedule_key FROM records WHERE workload_key = ? "
                                  "AND target_key = ?", (workload_key, target_key))
        return {row[0] for row in rows}

    def export_jsonl(self, path: str | os.PathLike, force: bool = False) -> int:
        """Writes every record, one JSON object a line; readers never see a half-written file. Never over
        the database itself or a folder, and over another existing file only with `force`."""
        path = Path(path)
        if self.path != Path(MEMORY) and path.resolve() in {Path(f"{self.path.resolve()}{s}") for s in ("", "-wal", "-shm")}:
            raise FlashgenError(f"{path} is the database being exported; write the JSON lines to another file.")
        if path.is_dir():  # (--force cannot help: a file never replaces a folder)
            raise FlashgenError(f"{path} is a folder, which an export never replaces; give a file path, such as "
                                f"{path / 'records.jsonl'}.")
        if path.exists() and not force:
            raise FlashgenError(f"{path} exists; pass --force to replace it.")
        records = self.records()
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        except OSError as exc:
            raise FlashgenError(f"cannot write {path} ({exc}); check the directory exists.") from None
        try:
            os.fchmod(fd, 0o644)  # mkstemp makes it private; a tuning log is meant to be shared
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                for record in records:
                    f.write(canonical_json(record.to_json()) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            os.unlink(tmp)
            if isinstance(exc, OSError):
                raise FlashgenError(f"cannot write {path} ({exc}); check the path.") from None
            raise
        return len(records)

    def import_jsonl(self, path: str | os.PathLike,
                     check: Callable[[Record], str | None] | None = None) -> tuple[int, int]:
        """Merges a JSON-lines log; returns (added, skipped as duplicates). All lines or none: a line that
        is not UTF-8, not JSON, not a Record, or that `check` finds a problem in, is refused with its
        number and nothing of the file is stored."""
        path = Path(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise FlashgenError(f"cannot read {path} ({exc.strerror or exc}); pass an existing JSON-lines "
                                "file.") from None
        records = []
        for number, raw in enumerate(data.split(b"\n"), start=1):  # not splitlines: U+2028 is text
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                rec = Record.from_json(json.loads(line))
                problem = check(rec) if check is not None else None
            except UnicodeDecodeError:
                problem = "not UTF-8 text"
            except json.JSONDecodeError as exc:
                problem = f"invalid JSON ({exc.msg})"
            except (RecursionError, ValueError, OverflowError):  # nesting or numbers past what JSON readers take
                problem = "JSON nested too deep or with numbers too large"
            except FlashgenError as exc:
                problem = str(exc).rstrip(".")
            if problem:
                raise FlashgenError(f"{path}:{number}: {problem}; fix or remove the line, nothing was imported.")
            records.append(rec)
        added = self.add_many(records)
        return added, len(records) - added

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
