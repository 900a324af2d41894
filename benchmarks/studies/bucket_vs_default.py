"""Replayed on the CPU: where dispatch serves a GEMM a record of another row count (a bucket), was that
schedule faster than the analytic default at the call's own rows? Both must have been measured on the
call's workload in the same record log (a tune times the default and the schedule dispatch serves
first), so every pair is two measurements of one workload on one GPU.

    python benchmarks/studies/bucket_vs_default.py benchmarks/results/h100_rows_records.jsonl [--name NAME]

For each GEMM with records at several row counts, each other row count's fastest schedule is compared
with the default wherever both were measured at the call's rows. Each row says how often each tile
reads the weight at the call's rows (`passes`: row tiles), and why dispatch would not serve the
bucket's schedule to that call (`ScheduleSpace.why_not_bucket`; empty: it may).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, environment, print_table, write_results  # noqa: E402

from flashgen.schedules.contraction_space import flat_of  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.targets.descriptor import get_target  # noqa: E402
from flashgen.workload import Workload  # noqa: E402


def _key(space: ScheduleSpace, s: dict) -> str:
    """A schedule as one string, in today's form."""
    return json.dumps(space.complete(s), sort_keys=True)


def _timings(paths: list[str]) -> dict[tuple[str, str], dict[str, float]]:
    """(target, workload JSON) -> {schedule (`_key`): fastest measured latency} over every ok record."""
    out: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for path in paths:
        for line in Path(path).read_text().splitlines():
            r = json.loads(line)
            if r["status"] != "ok" or not r.get("latency_us"):
                continue
            wl = Workload.from_json(r["workload"])
            if wl.op.kclass != "contraction":
                continue
            key = (r["target_key"], json.dumps(r["workload"], sort_keys=True))
            space = ScheduleSpace(wl, get_target(r["target_key"]))
            if not space.is_valid(r["schedule"]):
                continue
            sk = _key(space, r["schedule"])
            out[key][sk] = min(out[key].get(sk, float("inf")), r["latency_us"])
    return out


def _passes(wl: Workload, s: dict) -> int:
    """How many row tiles read the weight at `wl`'s rows."""
    return -(-wl.dim[wl.op.row_dims[0]] // flat_of(wl, s)["block_m"])


def pairs(paths: list[str]) -> list[list]:
    """One row per (workload, schedule fastest at other row counts of its group) where that schedule
    was measured on the workload beside the workload's analytic default."""
    times = _timings(paths)
    groups: dict[tuple, list[tuple[Workload, str, dict[str, float]]]] = defaultdict(list)
    for (target, wj), ts in times.items():
        wl = Workload.from_json(json.loads(wj))
        row = wl.op.row_dims[0]
        fixed = tuple(sorted((k, v) for k, v in wl.dim.items() if k != row))
        groups[(target, wl.op_name, json.dumps(wl.attr, sort_keys=True), fixed)].append((wl, target, ts))
    rows = []
    for members in groups.values():
        for wl, target, ts in members:
            space = ScheduleSpace(wl, get_target(target))
            m = wl.dim[wl.op.row_dims[0]]
            default = _key(space, space.default())
            if default not in ts:
                continue
            buckets: dict[str, list[int]] = defaultdict(list)  # schedule -> the row counts it is fastest at
            for o, _, ots in members:
                size = o.dim[o.op.row_dims[0]]
                sched = json.loads(min(ots, key=ots.get))
                sk = _key(space, sched) if space.is_valid(sched) else None
                if size != m and sk in ts and sk != default:
                    buckets[sk].append(size)
            for sk, sizes in buckets.items():
                sched = json.loads(sk)
                why = space.why_not_bucket(sched)
                rows.append([target.split("/")[-1], wl.op_name, m, wl.dim.get("N"), wl.dim.get("K"),
                             ",".join(map(str, sorted(sizes))), _passes(wl, sched), _passes(wl, space.default()),
                             ts[sk], ts[default], ts[sk] / ts[default], why or ""])
    return sorted(rows, key=lambda r: (r[0], r[1], r[2], r[3], r[4], r[5]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="bucket_vs_default")
    args = ap.parse_args()
    rows = pairs(args.records)
    header = ("device", "op", "M", "N", "K", "bucket_M", "bucket_passes", "default_passes", "bucket_us",
              "default_us", "bucket_over_default", "not_served")
    print_table(header, rows)
    note = ("Replayed on the CPU from the record logs named in the command. bucket_us: the fastest measured time, "
            "at the call's own rows, of the fastest schedule at other row counts (bucket_M) of the same GEMM; "
            "default_us: the analytic default's at the call's rows, both from the same log. passes: row tiles "
            "at the call's rows. not_served: why dispatch does not serve that schedule to the call as a bucket "
            "(`ScheduleSpace.why_not_bucket`; empty: it may).")
    write_results(args.name, header, rows, {**environment("CPU replay of the logs' records"), "records": args.records}, args.out_dir, note)


if __name__ == "__main__":
    main()
