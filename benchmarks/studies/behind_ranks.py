"""How the tuner's timing alone ranks the schedules that a tune behind a producer timed: a CPU replay
of recorded measurements (no device).

A tune behind a producer (`flashgen tune --behind`) times the default first, then the fastest schedules
timed alone (`schedules.tuner.ALONE_SEEDS`), then what its search proposes. Whether timing alone could
have stood in for it, and whether those seeds hold its winner, is read off the records: per record
file and workload, the rank correlation of the two timings over the schedules timed both ways, and
the alone rank of the schedule that was fastest behind the producer.

    python benchmarks/studies/behind_ranks.py RECORDS.jsonl [RECORDS.jsonl ...] [--name behind_ranks] [--out-dir DIR]

Records timed alone are pooled from every file given; each file's records timed behind a producer make
its own rows (one file per tuning protocol or lease).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, environment, print_table, write_results  # noqa: E402
from in_graph import ranks, spearman  # noqa: E402

from flashgen.db import Record  # noqa: E402
from flashgen.db.record import ALONE, canonical_json  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.targets import get_target  # noqa: E402
from flashgen.workload import Workload  # noqa: E402

HEADER = ("records", "workload", "behind", "timed_behind", "timed_both", "spearman", "best_behind_us",
          "its_alone_rank", "alone_schedules", "default_behind_rank")


def read(path: Path) -> list[Record]:
    return [Record.from_json(json.loads(line)) for line in path.open() if line.strip()]


def fastest(records: list[Record]) -> dict[str, dict[str, float]]:
    """Per workload key, each complete schedule's fastest ok latency (JSON text -> us)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for r in records:
        if r.status != "ok":
            continue
        space = ScheduleSpace(Workload.from_json(r.workload), get_target(r.target_key))
        key = canonical_json(space.complete(r.schedule))
        out[r.workload_key][key] = min(r.latency_us, out[r.workload_key].get(key, float("inf")))
    return out


def rows_for(name: str, behind: list[Record], alone: dict[str, dict[str, float]]) -> list[list]:
    """One row per workload timed behind a producer in this file."""
    rows = []
    timed = fastest(behind)
    for wk, lat in timed.items():
        rec = next(r for r in behind if r.workload_key == wk)
        wl = Workload.from_json(rec.workload)
        space = ScheduleSpace(wl, get_target(rec.target_key))
        mine = alone.get(wk, {})
        both = [k for k in lat if k in mine]
        alone_order = sorted(mine, key=mine.get)
        best = min(lat, key=lat.get)
        default = canonical_json(space.default())
        behind_rank = dict(zip(lat, ranks(list(lat.values()))))
        rows.append([name, str(wl), rec.extra.get("behind", {}).get("op", "?"), len(lat), len(both),
                     spearman([lat[k] for k in both], [mine[k] for k in both]), lat[best],
                     alone_order.index(best) + 1 if best in mine else None, len(mine), behind_rank.get(default)])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", type=Path)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="behind_ranks")
    args = ap.parse_args()
    files = {p: read(p) for p in args.records}
    alone = fastest([r for recs in files.values() for r in recs if r.timing == ALONE])
    rows = [row for p, recs in files.items()
            for row in rows_for(p.name, [r for r in recs if r.timing != ALONE], alone)]
    devices = sorted({r.device for recs in files.values() for r in recs})
    write_results(args.name, HEADER, rows, {**environment(", ".join(devices) or "none"), "files": [str(p) for p in args.records]},
                  args.out_dir, NOTE)
    print_table(HEADER[:2] + HEADER[3:], [r[:2] + r[3:] for r in rows])


NOTE = ("A CPU replay of recorded measurements. timed_both: schedules with records of both timings; "
        "spearman: rank correlation of their latency behind the producer with their fastest latency alone "
        "(1: the same order); its_alone_rank: where the fastest schedule behind the producer ranks among "
        "the workload's alone_schedules timed alone (None: never timed alone); default_behind_rank: the "
        "analytic default's rank behind the producer (the tune measures it first).")


if __name__ == "__main__":
    main()
