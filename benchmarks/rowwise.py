"""Rowwise and pointwise kernels against torch eager, torch.compile and the copy-bandwidth roofline,
measured side by side in one run on the current GPU: the analytic default schedule and, given a tuning
database, the tuned one (the database's best).

    python benchmarks/rowwise.py [--tuned-db DB] [--ops rmsnorm,rope] [--ms 1,32] [--out-dir DIR]

N is the hidden size; for rope it picks Llama-shaped heads (N=4096: Hq=32 Hkv=8 D=128; N=8192:
Hq=64 Hkv=8 D=128) and a 4096-entry cos/sin cache. Quantizing ops take fp16, the others bf16.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, bench_side_by_side, copy_gbs, environment, print_table, write_results  # noqa: E402
from peers import PEERS  # noqa: E402

import flashgen  # noqa: E402
from flashgen.check import check  # noqa: E402
from flashgen.db import Database  # noqa: E402
from flashgen.roofline import bytes_moved  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.targets import device_target  # noqa: E402

MS = (1, 32, 4096, 16384)
NS = (4096, 8192)
OPS = ("rmsnorm", "add_rmsnorm", "dynamic_quant", "rmsnorm_quant", "silu_mul", "rope")


def make_workload(op: str, m: int, n: int) -> flashgen.Workload:
    if op == "rope":
        return flashgen.workload("rope", M=m, Hq=n // 128, Hkv=8, D=128, L=4096, dtype="bf16")
    if op in ("dynamic_quant", "rmsnorm_quant"):
        return flashgen.workload(op, M=m, N=n, dtype="fp16", out_dtype="int8")
    return flashgen.workload(op, M=m, N=n, dtype="bf16")


def workloads(ops: list[str], ms: list[int]) -> list[flashgen.Workload]:
    return [make_workload(op, m, n) for op in ops for n in NS for m in ms]


def verified(wl, kernel, dev):
    bad = [c for c in check(wl, lambda i, o, p: kernel.run(i, o, p), 0, dev) if not c.ok]
    if bad:
        raise SystemExit(f"{wl} {kernel.schedule}: wrong result {bad}")
    return kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--tuned-db", help="tuning database whose best schedules are the tuned kernels")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    dev = torch.device("cuda")
    target = device_target(dev)
    l2 = target.get("l2_bytes")
    bw = copy_gbs()
    print(f"{target.id}: measured copy bandwidth {bw:.0f} GB/s", flush=True)
    db = Database(args.tuned_db) if args.tuned_db else None
    rows = []
    for op in args.ops.split(","):
        peer = PEERS[op]
        compiled = torch.compile(peer, dynamic=False)
        for wl in workloads([op], [int(m) for m in args.ms.split(",")]):
            default = verified(wl, flashgen.compile(wl, target, schedule=ScheduleSpace(wl, target).default()), dev)
            best = db.best(wl.key, target.id) if db else None
            tuned = verified(wl, flashgen.compile(wl, target, schedule=best.schedule), dev) if best else None
            gen = torch.Generator().manual_seed(1)
            ins = {k: v.to(dev) for k, v in wl.op.make_inputs(wl.dim, wl.attr, gen).items()}
            outs = {"default": default.run(ins)}
            fns = {"default": lambda: default.run(ins, outs["default"]), "eager": lambda: peer(**ins),
                   "compile": lambda: compiled(**ins)}
            if tuned:
                outs["tuned"] = tuned.run(ins)
                fns["tuned"] = lambda: tuned.run(ins, outs["tuned"])
            compiled(**ins)
            nbytes = bytes_moved(wl)
            t = bench_side_by_side(fns, nbytes, l2)
            roof = nbytes / (bw * 1e3)
            tt = t.get("tuned", float("nan"))
            n = wl.dim.get("N", wl.dim.get("Hq", 0) * 128)
            rows.append([op, wl.dim["M"], n, t["default"], tt, t["eager"], t["compile"], roof,
                         t["compile"] / t["default"], t["compile"] / tt, roof / t["default"], roof / tt,
                         t["default"] / tt, str(tuned.schedule if tuned else default.schedule)])
            print(f"{op:14s} M={wl.dim['M']:<6d} N={n:<5d} default {t['default']:8.2f} tuned {tt:8.2f} "
                  f"eager {t['eager']:8.2f} compile {t['compile']:8.2f} roof {roof:8.2f}", flush=True)
    header = ("op", "M", "N", "default_us", "tuned_us", "eager_us", "compile_us", "roofline_us",
              "default_vs_compile", "tuned_vs_compile", "default_of_roofline", "tuned_of_roofline",
              "tuned_vs_default", "schedule")
    meta = {**environment(), "target": target.id, "copy_gbs": bw, "tuned_db": args.tuned_db}
    note = ("Times are medians in microseconds, measured as the tuner measures candidates: L2 flushed (by "
            "reading a buffer twice its size) when a workload moves more than half the L2, else CUDA-graph "
            "replay with L2-hot inputs; versions interleaved over 3 rounds, best median kept. *_vs_compile = "
            "torch.compile time / flashgen time (above 1: flashgen faster). *_of_roofline = bytes moved / "
            f"measured copy bandwidth ({bw:.0f} GB/s) / time. default = analytic default schedule; tuned = "
            "the database's best schedule (schedule column).")
    write_results("rowwise", header, rows, meta, args.out_dir, note)
    print_table(("op", "M", "N", "default", "tuned", "compile", "tuned_vs_compile", "tuned_of_roof"),
                [(r[0], r[1], r[2], r[3], r[4], r[6], r[9], r[11]) for r in rows])


if __name__ == "__main__":
    main()
