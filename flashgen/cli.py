"""The `flashgen` command: ops, targets, compile, db.

User mistakes (bad op, dims, dtypes, targets, paths) end in one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from flashgen.errors import FlashgenError

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise FlashgenError(message)


def _pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got '{text}'")
    return name.strip(), value.strip()


def cmd_ops(args: argparse.Namespace) -> int:
    from flashgen.oplib import OPS
    from flashgen.table import print_table

    rows = []
    for op in OPS.values():
        attrs = " ".join(f"{k}={'|'.join(v)}" for k, v in op.attrs.items())
        params = " ".join(f"{k}={v:g}" for k, v in op.params.items()) or "-"
        rows.append((op.name, op.kclass, ",".join(op.dims), attrs, params, op.doc))
    print_table(("op", "class", "dims", "attrs (first is default)", "params", "description"), rows)
    return 0


def cmd_targets(args: argparse.Namespace) -> int:
    from flashgen.table import print_table
    from flashgen.targets import load_targets

    rows = [(t.id, ",".join(t.aliases), t.vendor, t.backend, str(t.sm_count or "-"),
             f"{t.mem_bandwidth_gbs:g}", ",".join(t.dtypes))
            for t in load_targets([args.targets_dir] if args.targets_dir else []).values()]
    print_table(("target", "names", "vendor", "backend", "SMs/CUs", "GB/s", "dtypes"), rows)
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from pathlib import Path

    import flashgen
    from flashgen.compiler import check_supported, resolve_target

    kw: dict[str, object] = dict(args.dim)
    kw.update(dict(args.attr))
    if args.dtype:
        kw["dtype"] = args.dtype
    wl = flashgen.workload(args.op, **kw)
    target = resolve_target(args.target, args.targets_dir)
    check_supported(wl, target)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise FlashgenError(f"--out {out} exists and is not a folder")
    schedule = json.loads(args.schedule) if args.schedule else None
    kernel = flashgen.compile(wl, target, schedule=schedule, db=args.db, targets_dir=args.targets_dir)
    files = kernel.save(out)
    print(f"{wl}  ->  {target.id}")
    print(f"workload key: {wl.key}")
    print(f"schedule: {json.dumps(kernel.schedule, sort_keys=True)}  [{kernel.metadata['schedule_source']}]")
    for f in files:
        print(f"wrote {f} ({f.stat().st_size} bytes)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from flashgen import __version__
    from flashgen.db import cli as db_cli

    p = _Parser(prog="flashgen", description="Generated, tuned kernels for LLM inference operators.")
    p.add_argument("--version", action="version", version=f"flashgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    ops = sub.add_parser("ops", help="list every op with its dims, attrs and description")
    ops.set_defaults(func=cmd_ops)

    tg = sub.add_parser("targets", help="list the target descriptors")
    tg.add_argument("--targets-dir", help="a folder of extra descriptor files (also $FLASHGEN_TARGETS_PATH)")
    tg.set_defaults(func=cmd_targets)

    c = sub.add_parser("compile", help="generate and build one kernel ahead of time (no GPU needed)")
    c.add_argument("op")
    c.add_argument("--dim", type=_pair, action="append", default=[], metavar="NAME=VALUE")
    c.add_argument("--dtype", help="activation dtype (bf16, fp16, fp32)")
    c.add_argument("--attr", type=_pair, action="append", default=[], metavar="NAME=VALUE",
                   help="another workload attribute, e.g. out_dtype=int8 or style=gptj")
    c.add_argument("--target", required=True, help="target id, architecture or device (see `flashgen targets`)")
    c.add_argument("--out", required=True, help="folder for source, binary, assembly and metadata")
    c.add_argument("--schedule", help="a schedule as JSON, instead of the database's best or the default")
    c.add_argument("--db", help="tuning database (default: $FLASHGEN_DB or the user cache folder)")
    c.add_argument("--targets-dir", help="a folder of extra descriptor files")
    c.set_defaults(func=cmd_compile)

    db_cli.register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except FlashgenError as e:
        print(f"flashgen: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except json.JSONDecodeError as e:
        print(f"flashgen: error: --schedule is not valid JSON: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("flashgen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
