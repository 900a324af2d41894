"""Tuning on the GPU: an exhaustive sweep that records every schedule, then the tuned kernels against
the analytic default, torch.compile, torch eager and the copy-bandwidth roofline, side by side.

    python benchmarks/search.py sweep  --db DB [--ops ...]   # measure every valid schedule (the yardstick)
    python benchmarks/search.py report --db DB               # tuned (database best) vs peers
    python benchmarks/search.py tune-time --db DB2           # wall time of `tune` for fresh workloads

Search quality (evolutionary + cost model vs random) and the cost model's top-k on unseen shapes are
computed from the sweep's records on the CPU: benchmarks/search_quality.py.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, bench_side_by_side, copy_gbs, environment, print_table, write_results  # noqa: E402
from peers import PEERS  # noqa: E402

import flashgen  # noqa: E402
from flashgen.db import Database  # noqa: E402
from flashgen.roofline import bytes_moved  # noqa: E402
from flashgen.schedules.builder import Builder  # noqa: E402
from flashgen.schedules.measure import Runner  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.schedules.tuner import tune  # noqa: E402
from flashgen.targets import target_for_device  # noqa: E402
from flashgen.targets.triton.launch import device_arch  # noqa: E402

OPS = ("rmsnorm", "add_rmsnorm", "dynamic_quant", "rmsnorm_quant", "silu_mul", "rope")
MS = (1, 32, 4096, 16384)
NS = (4096, 8192)


def workloads(ops: list[str]) -> list[flashgen.Workload]:
    out = []
    for op in ops:
        for n in NS:
            for m in MS:
                if op == "rope":
                    out.append(flashgen.workload("rope", M=m, Hq=n // 128, Hkv=8, D=128, L=4096, dtype="bf16"))
                elif op in ("dynamic_quant", "rmsnorm_quant"):
                    out.append(flashgen.workload(op, M=m, N=n, dtype="fp16", out_dtype="int8"))
                else:
                    out.append(flashgen.workload(op, M=m, N=n, dtype="bf16"))
    return out


def device_target():
    return target_for_device(torch.cuda.get_device_name(), device_arch(torch.device("cuda")))


def sweep(args: argparse.Namespace) -> None:
    target = device_target()
    wls = workloads(args.ops.split(","))
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
            res = tune(wl, target, db, len(scheds), strategy="exhaustive", builder=builder, runner=runner,
                       batch=64, progress=None)
            best = res.best.latency_us if res.best else float("nan")
            print(f"{str(wl):55s} {res.measured:4d} measured, best {best:8.2f} us, default "
                  f"{res.default_us or float('nan'):8.2f} us, {time.perf_counter() - t1:5.1f} s", flush=True)
    builder.close()
    runner.close()
    print(f"sweep done in {time.perf_counter() - t0:.0f} s")


def report(args: argparse.Namespace) -> None:
    torch._dynamo.config.cache_size_limit = 256
    target = device_target()
    dev = torch.device("cuda")
    bw = copy_gbs()
    l2 = target.get("l2_bytes")
    header = ("op", "M", "N", "tuned_us", "default_us", "compile_us", "eager_us", "roofline_us",
              "tuned_vs_compile", "tuned_vs_default", "of_roofline", "schedule")
    rows = []
    with Database(args.db) as db:
        for op in args.ops.split(","):
            compiled = torch.compile(PEERS[op], dynamic=False)
            for wl in workloads([op]):
                best = db.best(wl.key, target.id)
                if best is None:
                    print(f"{wl}: no record, skipped")
                    continue
                tuned = flashgen.compile(wl, target, db=db)
                default = flashgen.compile(wl, target, schedule=ScheduleSpace(wl, target).default())
                gen = torch.Generator().manual_seed(2)
                ins = {k: v.to(dev) for k, v in wl.op.make_inputs(wl.dim, wl.attr, gen).items()}
                o1, o2 = tuned.run(ins), default.run(ins)
                compiled(**ins)
                nbytes = bytes_moved(wl)
                t = bench_side_by_side({"tuned": lambda: tuned.run(ins, o1), "default": lambda: default.run(ins, o2),
                                        "compile": lambda: compiled(**ins), "eager": lambda: PEERS[op](**ins)},
                                       nbytes, l2)
                roof = nbytes / (bw * 1e3)
                rows.append((op, wl.dim["M"], wl.dim.get("N", wl.dim.get("Hq", 0) * 128), t["tuned"], t["default"],
                             t["compile"], t["eager"], roof, t["compile"] / t["tuned"], t["default"] / t["tuned"],
                             roof / t["tuned"], str(tuned.schedule)))
                print(f"{str(wl):55s} tuned {t['tuned']:8.2f}  default {t['default']:8.2f}  compile "
                      f"{t['compile']:8.2f}  roof {roof:8.2f}", flush=True)
    meta = {**environment(), "target": target.id, "copy_gbs": bw}
    note = ("tuned = the database's best schedule from the exhaustive sweep; times are medians, L2 flushed "
            "when a workload's bytes exceed half the L2, else CUDA-graph replay (hot L2), as the tuner "
            f"measures. of_roofline = bytes moved / measured copy bandwidth ({bw:.0f} GB/s) / tuned time.")
    write_results("search_tuned", header, rows, meta, args.out_dir, note)
    print_table(("op", "M", "N", "tuned", "vs_compile", "vs_default", "of_roof"),
                [(r[0], r[1], r[2], r[3], r[8], r[9], r[10]) for r in rows])


def tune_time(args: argparse.Namespace) -> None:
    """Wall time of a real evolutionary tune (compile included) of workloads not seen before."""
    target = device_target()
    rows = []
    with Database(args.db) as db:
        for wl in (flashgen.workload("rmsnorm", M=2048, N=5120, dtype="bf16"),
                   flashgen.workload("silu_mul", M=512, N=14336, dtype="bf16")):
            res = tune(wl, target, db, args.trials, strategy="evolutionary", progress=None)
            rows.append((str(wl), res.measured, res.wall_s, res.best.latency_us, res.default_us))
            print(f"{wl}: {res.measured} trials in {res.wall_s:.1f} s, best {res.best.latency_us:.2f} us, "
                  f"default {res.default_us:.2f} us", flush=True)
    write_results("search_tune_time", ("workload", "trials", "wall_s", "best_us", "default_us"), rows,
                  {**environment(), "target": target.id}, args.out_dir,
                  "Wall time of `tune` (evolutionary, fresh artifact cache: compile included).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=("sweep", "report", "tune-time"))
    ap.add_argument("--db", required=True)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--trials", type=int, default=48)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    {"sweep": sweep, "report": report, "tune-time": tune_time}[args.phase](args)


if __name__ == "__main__":
    main()
