"""`flashgen db ...`: look into, export and merge tuning logs from the shell."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flashgen.db.database import Database, default_db_path
from flashgen.db.record import STATUSES, Record, canonical_json
from flashgen.db.shipped import ENV, ORIGIN, TunedRecords, shipped_database, shipped_on, shipped_records
from flashgen.errors import FlashgenError
from flashgen.targets.descriptor import Target, get_target, load_targets
from flashgen.table import print_table

_SCHEDULE_WIDTH = 48
_USER, _SHIPPED = "database", "shipped"  # `db best`'s "from" column


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:  # ("²" is a digit int() refuses)
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Adds the `db` command to the main flashgen parser."""
    db = subparsers.add_parser("db", help="inspect, export and import the tuning database")
    commands = db.add_subparsers(dest="db_command", required=True, metavar="COMMAND")

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        parser = commands.add_parser(name, help=summary)
        parser.add_argument("--db", metavar="PATH", default=None,
                            help="database file (default: $FLASHGEN_DB or ~/.cache/flashgen/tuning.db)")
        return parser

    listing = command("list", "list records in insertion order")
    listing.add_argument("--workload", metavar="KEY", help="only this workload key")
    listing.add_argument("--target", metavar="NAME", help="only this target (a name compile --target takes)")
    listing.add_argument("--status", choices=STATUSES, help="only records with this status")
    listing.add_argument("--limit", metavar="N", type=_positive_int, help="show at most N records")
    listing.add_argument("--shipped", action="store_true",
                         help="the tuned records that ship with flashgen instead of a database")
    best = command("best", "the fastest correct record per workload and target")
    best.add_argument("--target", metavar="NAME", help="only this target (a name compile --target takes)")
    best.add_argument("--shipped", action="store_true", help="the tuned records that ship with flashgen")
    export = command("export", "write all records to a JSON-lines file")
    export.add_argument("file", metavar="FILE.jsonl")
    export.add_argument("--force", action="store_true", help="replace FILE.jsonl if it exists")
    command("import", "merge records from a JSON-lines file").add_argument("file", metavar="FILE.jsonl")
    db.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs one `db` sub-command; user problems surface as FlashgenError."""
    targets = _targets(args.target) if getattr(args, "target", None) else None
    args.target_ids = {t.id for t in targets} if targets is not None else None
    if getattr(args, "shipped", False):
        if args.db is not None:
            raise FlashgenError("--shipped lists the records that ship with flashgen; it takes no --db")
        shipped = _shipped()
        if shipped is None:
            return 0
        if args.db_command == "best":
            _print_served(TunedRecords(None, shipped), targets)
            return 0
        return _show(args, shipped)
    if args.db_command == "best":
        _best(args.db, targets)
        return 0
    with Database(args.db, readonly=args.db_command != "import") as database:
        return _show(args, database)


def _shipped() -> Database | None:
    """The shipped records for `--shipped`, else None with a line saying why there are none; files that
    failed their checks are named (all of them failing is an error: the install is damaged)."""
    if not shipped_on():
        print(f"no shipped records: {ENV}={os.environ[ENV]} turns them off")
        return None
    shipped, problems = shipped_records()
    if shipped is None:
        raise FlashgenError("no shipped records are served: " + ("; ".join(problems) or "none are installed"))
    for problem in problems:
        print(f"flashgen: warning: shipped records not served: {problem}", file=sys.stderr)
    return shipped


def _best(path: str | None, targets: list[Target] | None) -> None:
    """`db best` as dispatch serves it: the user's database, then the shipped records. A database named
    by --db must exist; without one (a fresh install), the shipped records alone."""
    db_path = Path(path).expanduser() if path is not None else default_db_path()
    shipped = shipped_database()
    if path is None and not db_path.exists() and shipped is not None:
        _print_served(TunedRecords(None, shipped), targets)
        return
    with Database(db_path, readonly=True) as user:
        _print_served(TunedRecords(user, shipped), targets)


def _show(args: argparse.Namespace, database: Database) -> int:
    """The listing, export or import a `db` sub-command asks of one database (`best` reads two: `_best`)."""
    if args.db_command == "list":
        records = _on(database.records(args.workload, None, args.status), args.target_ids)
        shown = records[: args.limit] if args.limit else records
        _print_records(shown)
        if len(shown) < len(records):
            print(f"({len(shown)} of {len(records)} records shown)")
    elif args.db_command == "export":
        count = database.export_jsonl(args.file, force=args.force)
        print(f"exported {count} records from {database.path} to {args.file}")
    elif args.db_command == "import":
        from flashgen.schedules.record_check import record_problem, stale_schedule  # spaces sit above the database

        stale: list[str] = []

        def check(rec: Record) -> str | None:
            problem = record_problem(rec)
            if problem is None and (why := stale_schedule(rec)):
                stale.append(why)
            return problem

        added, skipped = database.import_jsonl(args.file, check=check)
        print(f"imported {added} new records from {args.file} into {database.path} "
              f"({skipped} duplicates skipped)")
        if stale:
            print(f"{len(stale)} of the file's records have schedules today's space refuses (first: {stale[0]}): "
                  "kept as measurements for replays, never served")
    return 0


def _print_served(view: TunedRecords, targets: list[Target] | None) -> None:
    """`TunedRecords.served_all` on each target asked for (without --target, the best of every (workload,
    target) pair): per workload, the first record whose schedule today's space accepts (`unservable`);
    then a line counting the rows another device of the architecture lends, and one counting the stale
    records passed over."""
    from flashgen.schedules.record_check import unservable  # spaces sit above the database

    passed: dict[str, str] = {}  # content hash -> why (a read may ask of one record twice)

    def served(rec: Record) -> bool:
        why = unservable(rec)
        if why:
            passed[rec.content_hash] = why
        return why is None

    if targets is None:
        rows = view.best_all(None, served)
    else:
        found: dict[tuple[str, str], tuple[Record, str]] = {}
        for target in targets:
            for rec, origin in view.served_all(target, served):
                found.setdefault((rec.workload_key, rec.target_key), (rec, origin))
        rows = [found[k] for k in sorted(found)]
    _print_records([rec for rec, _ in rows], [_SHIPPED if origin == ORIGIN else _USER for _, origin in rows])
    ids = {t.id for t in targets} if targets is not None else None
    borrowed = sum(rec.target_key not in ids for rec, _ in rows) if ids is not None else 0
    if borrowed:
        print(f"({borrowed} records of another device of the architecture: dispatch serves them on "
              f"{', '.join(sorted(ids))} where it has none of its own)")
    if passed:
        print(f"({len(passed)} stale records passed over: today's space refuses their schedules, so dispatch "
              f"never serves them; first: {next(iter(passed.values()))})")


def _targets(name: str) -> list[Target]:
    """The targets a `--target` name reaches, as `compile --target` reads it: a device, or every device
    of an architecture named by its key or arch."""
    t = get_target(name)
    if name.lower() in (t.key.lower(), t.arch.lower()):
        return [x for x in load_targets().values() if x.key == t.key]
    return [t]


def _on(records: list[Record], ids: set[str] | None) -> list[Record]:
    return records if ids is None else [r for r in records if r.target_key in ids]


def _print_records(records: list[Record], origins: list[str] | None = None) -> None:
    """One row per record; `origins`: a "from" column (the user's database or the shipped records)."""
    if not records:
        print("no records")
        return
    header = ("op", "dims", "target", "status", "latency_us", "spread_us", "timing", "schedule", "workload_key")
    rows = [(str(r.workload.get("op", "?")), _dims(r.workload.get("dims")), r.target_key, r.status,
             _us(r.latency_us), _us(r.spread_us), _timing(r), _shorten(canonical_json(r.schedule)), r.workload_key)
            for r in records]
    if origins is not None:
        header, rows = (*header, "from"), [(*row, origin) for row, origin in zip(rows, origins)]
    print_table(header, rows)


def _timing(r: Record) -> str:
    """alone, or behind OP: the producer kernel the latency was measured after."""
    behind = r.extra.get("behind")
    return f"{r.timing} {behind.get('op', '?')}" if isinstance(behind, dict) else r.timing


def _dims(dims: object) -> str:
    if isinstance(dims, dict):
        return ",".join(f"{k}={v}" for k, v in dims.items())
    if isinstance(dims, (list, tuple)):
        return "x".join(str(d) for d in dims)
    return "-" if dims is None else str(dims)


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _shorten(text: str) -> str:
    return text if len(text) <= _SCHEDULE_WIDTH else text[: _SCHEDULE_WIDTH - 3] + "..."
