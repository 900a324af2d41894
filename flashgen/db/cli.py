"""`flashgen db ...`: look into, export and merge tuning logs from the shell."""

from __future__ import annotations

import argparse

from flashgen.db.database import Database
from flashgen.db.record import STATUSES, Record, canonical_json
from flashgen.db.shipped import ENV, shipped_database
from flashgen.errors import FlashgenError
from flashgen.table import print_table

_SCHEDULE_WIDTH = 48


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
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
    listing.add_argument("--target", metavar="KEY", help="only this target key")
    listing.add_argument("--status", choices=STATUSES, help="only records with this status")
    listing.add_argument("--limit", metavar="N", type=_positive_int, help="show at most N records")
    listing.add_argument("--shipped", action="store_true",
                         help="the tuned records that ship with flashgen instead of a database")
    best = command("best", "the fastest correct record per workload and target")
    best.add_argument("--target", metavar="KEY", help="only this target key")
    best.add_argument("--shipped", action="store_true", help="the tuned records that ship with flashgen")
    command("export", "write all records to a JSON-lines file").add_argument("file", metavar="FILE.jsonl")
    command("import", "merge records from a JSON-lines file").add_argument("file", metavar="FILE.jsonl")
    db.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Runs one `db` sub-command; user problems surface as FlashgenError."""
    if getattr(args, "shipped", False):
        if args.db is not None:
            raise FlashgenError("--shipped lists the records that ship with flashgen; it takes no --db")
        shipped = shipped_database()
        if shipped is None:
            print(f"no shipped records ({ENV}=0, or none installed)")
            return 0
        return _show(args, shipped)
    with Database(args.db) as database:
        return _show(args, database)


def _show(args: argparse.Namespace, database: Database) -> int:
    """The listing, export or import a `db` sub-command asks of one database."""
    if args.db_command == "list":
        records = database.records(args.workload, args.target, args.status)
        shown = records[: args.limit] if args.limit else records
        _print_records(shown)
        if len(shown) < len(records):
            print(f"({len(shown)} of {len(records)} records shown)")
    elif args.db_command == "best":
        _print_records(database.best_all(args.target))
    elif args.db_command == "export":
        count = database.export_jsonl(args.file)
        print(f"exported {count} records from {database.path} to {args.file}")
    elif args.db_command == "import":
        added, skipped = database.import_jsonl(args.file)
        print(f"imported {added} new records from {args.file} into {database.path} "
              f"({skipped} duplicates skipped)")
    return 0


def _print_records(records: list[Record]) -> None:
    if not records:
        print("no records")
        return
    header = ("op", "dims", "target", "status", "latency_us", "spread_us", "timing", "schedule", "workload_key")
    rows = [(str(r.workload.get("op", "?")), _dims(r.workload.get("dims")), r.target_key, r.status,
             _us(r.latency_us), _us(r.spread_us), _timing(r), _shorten(canonical_json(r.schedule)), r.workload_key)
            for r in records]
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
