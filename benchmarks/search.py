"""Tuning on the GPU: an exhaustive sweep that records every valid schedule of the benchmark workloads
(the yardstick of search quality), and the wall time of real tunes of shapes the sweep did not see.

    python benchmarks/search.py sweep --db DB [--ops ...]
    python benchmarks/search.py tune-time --db DB [--trials 48]

The tuned kernels are compared with torch.compile, eager and the roofline by
`benchmarks/rowwise.py --tuned-db DB`; search quality (evolutionary + cost model vs random) and the
cost model's top-k on unseen shapes are replayed from the sweep's records on the CPU by
benchmarks/search_quality.py.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, write_results  # noqa: E402
from rowwise import workloads  # noqa: E402

import flashgen  # noqa: E402
from flashgen.db import Database  # noqa: E402
from flashgen.schedules.builder import Builder  # noqa: E402
from flashgen.schedules.measure import Runner  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.schedules.tuner import TuneTask, tune  # noqa: E402
from flashgen.targets import device_target  # noqa: E402

OPS = ("rmsnorm", "add_rmsnorm", "dynamic_quant", "rmsnorm_quant", "silu_mul", "rope")
MS = (1, 32, 4096, 16384)


def sweep(args: argparse.Namespace) -> None:
    target = device_target("cuda")
    wls = workloads(args.ops.split(","), [int(m) for m in args.ms.split(",")])
    builder, runner = Builder(target, workers=args.workers), Runner(target, timeout_s=60)
    t0 = time.perf_counter()
    plan = [(wl, list(ScheduleSpace(wl, target))) for wl in wls]
    print(f"{sum(len(s) for _, s in plan)} candidates over {len(plan)} workloads", flush=True)
    errors = {}
    for wl, scheds in plan:  # every build first, on every core
        errors[wl.key] = builder.build(wl, scheds)
    print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    with Database(args.db) as db:
        for wl, scheds in plan:
            t1 = time.perf_counter()
            res = tune(TuneTask(wl, target, len(scheds), strategy="exhaustive"), db, builder=builder, runner=runner,
                       batch=64, progress=None)
            best = res.best.latency_us if res.best else float("nan")
            print(f"{str(wl):55s} {res.measured:4d} measured, best {best:8.2f} us, default "
                  f"{res.default_us or float('nan'):8.2f} us, {time.perf_counter() - t1:5.1f} s", flush=True)
    builder.close()
    runner.close()
    print(f"sweep done in {time.perf_counter() - t0:.0f} s")


def tune_time(args: argparse.Namespace) -> None:
    """Wall time of a real evolutionary tune (compile included) of workloads not seen before."""
    target = device_target("cuda")
    rows = []
    with Database(args.db) as db:
        for wl in (flashgen.workload("rmsnorm", M=2048, N=5120, dtype="bf16"),
                   flashgen.workload("silu_mul", M=512, N=14336, dtype="bf16")):
            res = tune(TuneTask(wl, target, args.trials, strategy="evolutionary"), db, progress=None)
            best = res.best.latency_us if res.best else float("nan")
            rows.append((str(wl), res.measured, res.wall_s, best, res.default_us or float("nan")))
            print(f"{wl}: {res.measured} trials in {res.wall_s:.1f} s, best {best:.2f} us, "
                  f"default {res.default_us} us", flush=True)
    write_results("search_tune_time", ("workload", "trials", "wall_s", "best_us", "default_us"), rows,
                  {**environment(), "target": target.id}, args.out_dir,
                  "Wall time of `tune` (evolutionary, fresh artifact cache: compile included).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("sweep", "tune-time"))
    ap.add_argument("--db", required=True)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--trials", type=int, default=48)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    {"sweep": sweep, "tune-time": tune_time}[args.phase](args)


if __name__ == "__main__":
    main()
