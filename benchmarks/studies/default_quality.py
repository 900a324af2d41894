"""How close the analytic default schedule comes to the best recorded one, replayed on the CPU from the
H200 records: the default is what `flashgen compile` and the runtime build when the database has no
record of a workload, and the first schedule every tune measures.

    python benchmarks/studies/default_quality.py benchmarks/results/h200_gemm_records.jsonl [--m 1] [--name default_quality]

For each workload whose default schedule has a record: its latency, the best recorded latency and
their ratio (best / default; 1.0: the default is the best recorded). Workloads whose default was never
measured are counted, not scored.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, environment, print_table, replayed_records, write_results  # noqa: E402

from flashgen.db.record import schedule_key  # noqa: E402
from flashgen.schedules.cost_model import samples_from_records  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path, help="JSON-lines records (flashgen db export)")
    ap.add_argument("--m", type=int, default=None, help="only workloads with this M")
    ap.add_argument("--name", default="default_quality")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    with replayed_records(args.records) as (db, _):
        samples = samples_from_records(db.records(), "contraction")
    times: dict[tuple, dict[str, float]] = defaultdict(dict)
    spaces: dict[tuple, tuple] = {}
    for wl, schedule, target, latency in samples:
        if args.m is not None and wl.dim["M"] != args.m:
            continue
        group = (wl.key, target.id)
        if group not in spaces:
            spaces[group] = (wl, ScheduleSpace(wl, target))
        key = schedule_key(spaces[group][1].complete(schedule))
        times[group][key] = min(latency, times[group].get(key, float("inf")))
    rows, unmeasured = [], 0
    for group, (wl, space) in sorted(spaces.items(), key=lambda g: (g[1][0].op.name, str(g[1][0].dim))):
        default = times[group].get(schedule_key(space.complete(space.default())))
        if default is None:
            unmeasured += 1
            continue
        best = min(times[group].values())
        dims = " ".join(f"{k}={v}" for k, v in wl.dim.items())
        rows.append([wl.op.name, wl.attr.get("dtype", ""), dims, round(default, 2), round(best, 2), round(best / default, 3)])
    header = ("op", "dtype", "dims", "default_us", "best_us", "best/default")
    note = (f"{len(rows)} workloads of `{args.records.name}` whose analytic default has a record"
            f"{f' (M={args.m})' if args.m is not None else ''}; {unmeasured} more have records but none of their default.")
    write_results(args.name, header, rows, environment(device="CPU replay of H200 records"), args.out_dir, note)
    print_table(header, rows)
    print(note)


if __name__ == "__main__":
    main()
