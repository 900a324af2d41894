"""Generated GEMMs against cuBLAS (torch.matmul), torch._int_mm, torch._scaled_mm and the roofline,
side by side in one run on the current GPU. Each workload is tuned briefly first (the analytic default
plus the prior's best few schedules, every candidate checked against the float64 reference), and the
database's best is what is timed.

    python benchmarks/gemm.py --db DB [--trials 6] [--ops gemm,gemm_w4a16,gemm_w8a8,gemm_fp8] [--ms 1,16,64,256,4096]
        [--shapes 8192x8192,qkv,o,gate_up,down] [--name gemm] [--fix tma=1 ...] [--rounds 2]
        [--variant dequant_chunks=4 ...] [--best-with early_load=1 ...] [--flush-l2]

Peers: gemm (bf16) vs torch.matmul bf16; gemm_w4a16 (group 128, symmetric) vs torch.matmul fp16 on the
dequantized weight; gemm_w8a8 (scales fused) vs torch._int_mm (no scales); gemm_fp8 (scales fused) vs
torch._scaled_mm with the same row/column scales. Roofline = max(flops / datasheet peak, bytes / measured
copy bandwidth). Beside them, `read`: the faster of two torch passes over the weight's bytes (the
maximum of its int32 words; a copy of them), in the same timing, so peer / read is about what a kernel
that did nothing but read its weight would reach against the peer, launch and ramp included.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (RESULTS, bench_side_by_side, copy_gbs, environment, knob_values, print_table,  # noqa: E402
                    tuning_session, variant, write_results)

import flashgen  # noqa: E402
from flashgen.db import Database  # noqa: E402
from flashgen.quant import unpack_int4  # noqa: E402
from flashgen.roofline import bytes_moved  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.schedules.tuner import TuneTask, tune  # noqa: E402
from flashgen.targets import device_target  # noqa: E402

SHAPES = {"8192x8192": (8192, 8192), "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
OPS = ("gemm", "gemm_w4a16", "gemm_w8a8", "gemm_fp8")


def make_workload(op: str, m: int, n: int, k: int) -> flashgen.Workload:
    if op == "gemm":
        return flashgen.workload("gemm", M=m, N=n, K=k, dtype="bf16")
    if op == "gemm_w4a16":
        return flashgen.workload("gemm_w4a16", M=m, N=n, K=k, G=128, dtype="fp16")
    return flashgen.workload(op, M=m, N=n, K=k, dtype="bf16")


def peer(op: str, ins: dict):
    """The named library call for this op, on the same inputs (None where the library refuses)."""
    if op == "gemm":
        x, wt = ins["x"], ins["w"].t()
        return lambda: torch.matmul(x, wt)
    if op == "gemm_w4a16":
        codes = unpack_int4(ins["w_packed"].cpu(), ins["x"].shape[1]).to(ins["x"].device)
        w = ((codes.to(torch.float16) - 8) * ins["scales"].repeat_interleave(128, 1)).t()
        x = ins["x"]
        return lambda: torch.matmul(x, w)
    if op == "gemm_w8a8":
        x, wt = ins["x"], ins["w"].t()
        fn = lambda: torch._int_mm(x, wt)  # noqa: E731
    else:
        x, wt = ins["x"], ins["w"].t()
        sa, sb = ins["x_scale"][:, None].contiguous(), ins["w_scale"][None, :].contiguous()
        fn = lambda: torch._scaled_mm(x, wt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)  # noqa: E731
    try:
        fn()
        torch.cuda.synchronize()
        return fn
    except RuntimeError as e:
        print(f"  peer refused: {str(e).splitlines()[0][:100]}")
        return None


def weight_reads(ins: dict[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    """Two torch passes over the weight's bytes (packed words or a 16-bit matrix) viewed as int32: their
    maximum, and a copy. About the least a kernel reading the weight once costs in this timing (an
    int64 sum, the L2 flush's own pass, runs at a fraction of the copy bandwidth: measured, not used)."""
    w = ins["w_packed"] if "w_packed" in ins else ins["w"]
    words = w.reshape(-1).view(torch.int32)
    top, dst = torch.empty((), dtype=torch.int32, device=w.device), torch.empty_like(words)
    return {"read max": lambda: torch.amax(words, dim=0, out=top), "read copy": lambda: dst.copy_(words)}


def _best_with(db: Database, wl: flashgen.Workload, target, space: ScheduleSpace, knob: str, value: int):
    """The fastest correct record of `wl` whose schedule has `knob` = `value`, of those timed as the
    database's best was (`Database.best`: behind a producer where the workload has such records); None
    if there is none."""
    timing = db.best(wl.key, target.id).timing
    recs = [r for r in db.records(wl.key, target.id, status="ok")
            if r.timing == timing and space.flat(r.schedule).get(knob) == value]
    return min(recs, key=lambda r: r.latency_us, default=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--ms", default="1,16,64,256,4096")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="gemm", help="result files: <out-dir>/<name>.json and .md")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds of flashgen and its peer")
    ap.add_argument("--best-with", action="append", default=[], metavar="KNOB=VALUE",
                    help="also time the database's best record with this knob value, side by side (repeatable; a row each)")
    ap.add_argument("--variant", action="append", default=[], metavar="KNOB=VALUE",
                    help="also time the best schedule with this knob changed, side by side (repeatable; a row each)")
    ap.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                    help="tune only schedules with this knob value (repeatable); the database's best is timed")
    ap.add_argument("--flush-l2", action="store_true",
                    help="time every call after an L2 flush, the weight read from memory as a decode step's layers "
                         "read theirs (default: flushed only when the data outgrows half the L2, the tuner's rule)")
    args = ap.parse_args()
    fixed = knob_values(args.fix)
    variants = [pair for arg in args.variant for pair in knob_values([arg]).items()]
    best_with = [pair for arg in args.best_with for pair in knob_values([arg]).items()]
    dev = torch.device("cuda")
    target = device_target(dev)
    bw = copy_gbs()
    header = ("op", "shape", "M", "N", "K", "flashgen_us", "peer", "peer_us", "vs_peer", "read_us", "read_vs_peer",
              "roofline_us", "of_roofline", "TFLOP/s", "schedule")
    rows = []
    t0 = time.perf_counter()
    with Database(args.db) as db, tuning_session(target) as session:
        for op in args.ops.split(","):
            for shape in args.shapes.split(","):
                n, k = SHAPES[shape]
                for m in map(int, args.ms.split(",")):
                    wl = make_workload(op, m, n, k)
                    task = TuneTask(wl, target, args.trials, strategy="evolutionary", fixed=TuneTask.pinned(fixed))
                    res = tune(task, db, progress=None, **session)
                    if res.best is None:
                        print(f"{wl}: no correct schedule" + ("" if args.trials else " recorded (--trials 0 measures none)"),
                              flush=True)
                        continue
                    kern = flashgen.compile(wl, target, db=db)
                    gen = torch.Generator().manual_seed(3)
                    ins = {kk: v.to(dev) for kk, v in wl.op.make_inputs(wl.dim, wl.attr, gen).items()}
                    out = kern.run(ins)
                    fns = {"flashgen": lambda: kern.run(ins, out)}
                    scheds = {"flashgen": kern.schedule}
                    space = ScheduleSpace(wl, target)
                    for knob, value in variants:
                        if (found := variant(wl, target, space, kern.schedule, knob, value, ins, out)) is not None:
                            vk, scheds[f"{knob}={value}"] = found
                            fns[f"{knob}={value}"] = lambda vk=vk: vk.run(ins, out)
                    for knob, value in best_with:
                        rec = _best_with(db, wl, target, space, knob, value)
                        if rec is not None and space.complete(rec.schedule) != space.complete(kern.schedule):
                            bk = flashgen.compile(wl, target, schedule=rec.schedule)
                            label = f"best {knob}={value}"
                            fns[label], scheds[label] = (lambda bk=bk: bk.run(ins, out)), rec.schedule
                    p = peer(op, ins)
                    if p is not None:
                        fns["peer"] = p
                    fns.update(weight_reads(ins))
                    nbytes = bytes_moved(wl)
                    t = bench_side_by_side(fns, nbytes, target.get("l2_bytes"), rounds=args.rounds,
                                           flush=True if args.flush_l2 else None)
                    t["read"] = min(t["read max"], t["read copy"])
                    flops = 2.0 * m * n * k
                    peak = target.peak_tflops.get(wl.tensor_dtype("x"), target.peak_tflops["bf16"])
                    roof = max(flops / (peak * 1e6), nbytes / (bw * 1e3))
                    pt = t.get("peer", float("nan"))
                    for label, sched in scheds.items():
                        rows.append([op if label == "flashgen" else f"{op} [{label}]", shape, m, n, k, t[label],
                                     {"gemm": "cuBLAS bf16", "gemm_w4a16": "cuBLAS fp16", "gemm_w8a8": "_int_mm",
                                      "gemm_fp8": "_scaled_mm"}[op], pt, pt / t[label], t["read"], pt / t["read"],
                                     roof, roof / t[label],
                                     flops / (t[label] * 1e6), str(sched)])
                    print(f"{op:11s} {shape:9s} M={m:<5d} flashgen {t['flashgen']:9.2f} us  peer {pt:9.2f}  "
                          f"read {t['read']:8.2f}  roof {roof:8.2f}  ({time.perf_counter() - t0:.0f}s)", flush=True)
                    write_results(args.name, header, rows, {**environment(), "target": target.id, "copy_gbs": bw},
                                  args.out_dir, (NOTE if args.trials else RETIME_NOTE).format(trials=args.trials, bw=bw)
                                  + (FLUSH_NOTE if args.flush_l2 else ""))
    print_table(("op", "shape", "M", "us", "vs_peer", "read_vs_peer", "of_roof"),
                [(r[0], r[1], r[2], r[5], r[8], r[10], r[12]) for r in rows])


ROOFLINE_NOTE = ("vs_peer = peer time / flashgen time (above 1: flashgen faster). read_us: the faster of two torch "
                 "passes over the weight's bytes (the maximum of its int32 words, a copy), timed alike; read_vs_peer = "
                 "peer time / read time, about what a kernel that only read its weight would reach. Roofline = max(flops / datasheet peak, bytes / measured copy bandwidth "
                 "{bw:.0f} GB/s).")
FLUSH_NOTE = " Every call timed after an L2 flush (--flush-l2): weights and activations come from memory."
NOTE = ("Each workload tuned with {trials} new measured schedules (the analytic default first, then the cost "
        "model's ranking: XGBoost trained on the database's GEMM records so far, the analytic prior before there are "
        "any). " + ROOFLINE_NOTE)
RETIME_NOTE = "No new schedules: each workload's best record in the database is timed. " + ROOFLINE_NOTE


if __name__ == "__main__":
    main()
