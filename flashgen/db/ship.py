"""Maintainers: rebuild one device's shipped records from tuning-record logs.

python -m flashgen.db.ship DEVICE FILE.jsonl [FILE.jsonl ...]
"""
from __future__ import annotations

import sys

from flashgen.db.database import MEMORY, Database
from flashgen.db.shipped import write_shipped
from flashgen.errors import FlashgenError


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    device, files = argv[0], argv[1:]
    try:
        db = Database(MEMORY)
        for f in files:
            db.import_jsonl(f)
    except FlashgenError as e:
        print(f"flashgen: error: {e}", file=sys.stderr)
        return 2
    path = write_shipped(db.records(), device)
    print(f"wrote {path} from {len(files)} record files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
