"""Maintainers: rebuild one device's shipped records from tuning-record logs.

python -m flashgen.db.ship DEVICE FILE.jsonl [FILE.jsonl ...] [--drop]

A rebuild that would leave out a workload the device's file ships now is refused unless --drop is given.
"""
from __future__ import annotations

import sys

from flashgen.db.database import MEMORY, Database
from flashgen.db.shipped import write_shipped
from flashgen.errors import FlashgenError


def main(argv: list[str]) -> int:
    drop = "--drop" in argv
    argv = [a for a in argv if a != "--drop"]
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    device, files = argv[0], argv[1:]
    try:
        db = Database(MEMORY)
        for f in files:
            db.import_jsonl(f)
        path = write_shipped(db.records(), device, drop=drop)
    except FlashgenError as e:
        print(f"flashgen: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} from {len(files)} record files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
