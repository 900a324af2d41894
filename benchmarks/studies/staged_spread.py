"""How much a staged W4A16 schedule's time moves between timings: the evidence behind the space's rule
that Gluon tiles of a weight dequantized first run in one chunk.

Per shape at M rows, the fastest recorded `dequant_first` schedule of each (generator, dequant_chunks)
pair is built directly (the space's validity rules skipped, so that refused forms are timed too), then
timed `--repeats` times one after another (each the median of the tuner's 30 runs, with its power
warm-up) and once more in interleaved rounds beside cuBLAS fp16 on the dequantized weight. A schedule
whose repeats spread far apart cannot be ranked by one record of it.

    python benchmarks/studies/staged_spread.py --db DB [--shapes o] [--m 4096] [--repeats 4] [--name staged_spread]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, bench_side_by_side, environment, print_table, write_results  # noqa: E402
from gemm import SHAPES, make_workload, peer  # noqa: E402

from flashgen.db import Database  # noqa: E402
from flashgen.db.record import ALONE  # noqa: E402
from flashgen.roofline import bytes_moved  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.schedules.timing import gpu_time  # noqa: E402
from flashgen.targets import device_target  # noqa: E402
from flashgen.targets.descriptor import siblings  # noqa: E402
from flashgen.targets.triton import build  # noqa: E402

GENERATORS = {0: "triton", 1: "gluon"}


def staged_bests(db: Database, wl: Any, target: Any) -> dict[tuple[int, int], Any]:
    """(backend, dequant_chunks) -> the fastest ok record of that pair timed alone, from the target's records or,
    where it has none, another device's of its architecture."""
    for t in (target, *siblings(target)):
        best: dict[tuple[int, int], Any] = {}
        space = ScheduleSpace(wl, t)
        for rec in db.records(wl.key, t.id):
            s = space.flat(rec.schedule)
            if rec.status != "ok" or rec.timing != ALONE or not s.get("dequant_first"):
                continue
            pair = (s.get("backend", 0), s.get("dequant_chunks", 1))
            if pair not in best or rec.latency_us < best[pair].latency_us:
                best[pair] = rec
        if best:
            return best
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True, help="tuning database holding staged W4A16 records")
    ap.add_argument("--shapes", default="o")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=4, help="timings of each schedule, one after another")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds beside cuBLAS")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="staged_spread")
    args = ap.parse_args()
    dev = torch.device("cuda")
    target = device_target(dev)
    l2 = target.get("l2_bytes", 1 << 26)
    header = ("shape", "M", "generator", "chunks", "recorded_us", "recorded_on", "repeats_us", "min_us",
              "max_us", "max_over_min", "interleaved_us", "valid_now", "schedule")
    rows = []
    with Database(args.db) as db:
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            wl = make_workload("gemm_w4a16", args.m, n, k)
            space = ScheduleSpace(wl, target)
            ins = {a: v.to(dev) for a, v in wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(3)).items()}
            fns, found = {"cuBLAS fp16": peer("gemm_w4a16", ins)}, {}
            for (backend, chunks), rec in sorted(staged_bests(db, wl, target).items()):
                sched = space.complete(rec.schedule)
                kern = build(wl, sched, target)
                out = kern.run(ins)
                fn = lambda kern=kern, out=out: kern.run(ins, out)  # noqa: E731
                reps = [gpu_time(fn, dev, True, l2).median_us for _ in range(args.repeats)]
                label = f"{GENERATORS[backend]} c{chunks}"
                print(f"{shape:8s} {label:9s} recorded {rec.latency_us:8.1f}  repeats "
                      f"{', '.join(f'{r:.1f}' for r in reps)}", flush=True)
                fns[label], found[label] = fn, (backend, chunks, rec, reps, space.why_invalid(sched) is None, sched)
            inter = bench_side_by_side(fns, bytes_moved(wl), l2, rounds=args.rounds, flush=True)
            for label, (backend, chunks, rec, reps, valid, sched) in found.items():
                rows.append([shape, args.m, GENERATORS[backend], chunks, rec.latency_us, rec.device, reps, min(reps),
                             max(reps), max(reps) / min(reps), inter[label], valid, str(sched)])
            rows.append([shape, args.m, "cuBLAS fp16", "", "", "", "", "", "", "", inter["cuBLAS fp16"], "", "torch.matmul"])
            del fns
            torch.cuda.empty_cache()
    note = (f"repeats_us: {args.repeats} timings one after another, each the median of 30 runs after the L2 flush "
            f"and power warm-up; interleaved_us: best median of {args.rounds} interleaved rounds beside cuBLAS; "
            "valid_now: whether today's space admits the schedule; recorded_us: the record's own latency "
            "(on recorded_on).")
    write_results(args.name, header, rows, {**environment(), "target": target.id}, args.out_dir, note)
    print_table(("shape", "generator", "chunks", "min_us", "max_us", "max_over_min", "interleaved_us", "valid_now"),
                [(r[0], r[2], r[3], r[7], r[8], r[9], r[10], r[11]) for r in rows])


if __name__ == "__main__":
    main()
