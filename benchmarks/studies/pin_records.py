"""Record files in which one workload keeps only some of its records, so that dispatch (which takes a
workload's best record) runs a chosen schedule: how to time a schedule inside the decoder's CUDA graph,
where its cost can differ from the tuner's measurement of it alone.

    python benchmarks/studies/pin_records.py OUT.jsonl RECORDS.jsonl [RECORDS.jsonl ...] --op paged_decode_attention
        --dim B=1 --dim L=2560 (--schedule JSON | --knob early_kv=1)

Every record of other workloads is kept. Of the matching workload's records, --schedule keeps those of
that schedule (knobs a record predates read as their neutral value), --knob those with that knob value.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashgen.errors import FlashgenError
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from flashgen.workload import Workload


def matches(record: dict, op: str, dims: dict[str, int]) -> bool:
    w = record["workload"]
    return w["op"] == op and all(w["dims"].get(k) == v for k, v in dims.items())


def keeps(record: dict, schedule: dict | None, knob: tuple[str, int] | None) -> bool:
    """Whether a record of the pinned workload has the chosen schedule (or knob value)."""
    space = ScheduleSpace(Workload.from_json(record["workload"]), get_target(record["target_key"]))
    if schedule is not None:
        return space.complete(record["schedule"]) == space.complete(schedule)
    return space.flat(record["schedule"]).get(knob[0]) == knob[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("records", nargs="+", type=Path)
    ap.add_argument("--op", required=True)
    ap.add_argument("--dim", action="append", default=[], metavar="NAME=VALUE")
    pick = ap.add_mutually_exclusive_group(required=True)
    pick.add_argument("--schedule", help="the schedule to keep, as JSON")
    pick.add_argument("--knob", metavar="NAME=VALUE", help="keep the records with this knob value")
    args = ap.parse_args()
    dims = {k: int(v) for k, _, v in (d.partition("=") for d in args.dim)}
    schedule = json.loads(args.schedule) if args.schedule else None
    knob = None
    if args.knob:
        name, _, value = args.knob.partition("=")
        knob = (name, int(value))
    kept = pinned = dropped = 0
    with args.out.open("w") as out:
        for path in args.records:
            for line in path.open():
                r = json.loads(line)
                mine = matches(r, args.op, dims)
                if not mine or keeps(r, schedule, knob):
                    out.write(line)
                    kept += 1
                    pinned += mine
                else:
                    dropped += 1
    print(f"{args.out}: {kept} records, {pinned} of them of {args.op} {dims}; {dropped} dropped")
    if not pinned:  # dispatch would fall back to another workload's record: nothing would be pinned
        raise FlashgenError(f"no record of {args.op} {dims} is left to pin")


if __name__ == "__main__":
    main()
