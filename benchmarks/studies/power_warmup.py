"""Cold against sustained timings of long GEMMs: why a tuner times them after back-to-back calls.

Per shape at M rows: the W4A16 GEMM's dispatched kernel (at M = 4096, the weight dequantized first), the
bf16 GEMM's and cuBLAS fp16 on the W4A16 weight's values. Each is timed cold (after `--idle` seconds
idle, 5 ms of warm-up, no power warm-up: how the tuner timed candidates before) and warm (the default
`gpu_time`: first `POWER_WARMUP_MS` of back-to-back calls), with the SM clock, power draw and temperature
that nvidia-smi reads right after each; then in interleaved rounds, as `gemm.py` times them.

    python benchmarks/studies/power_warmup.py --db DB [--shapes gate_up,down] [--m 4096] [--idle 1.5] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, bench_side_by_side, environment, print_table, write_results  # noqa: E402
from gemm import SHAPES, make_workload, peer  # noqa: E402

import flashgen  # noqa: E402
from flashgen.db import Database  # noqa: E402
from flashgen.workload import Workload  # noqa: E402
from flashgen.roofline import bytes_moved  # noqa: E402
from flashgen.schedules.timing import POWER_WARMUP_MS, gpu_time  # noqa: E402
from flashgen.targets import device_target  # noqa: E402


def card_state() -> str:
    """SM clock, power draw and temperature now (nvidia-smi), or why they cannot be read."""
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi: {e}"
    return q.stdout.strip().replace(", ", " / ") + " C"


def shape_calls(db: Database, target: Any, shape: str, m: int, dev: torch.device
                ) -> tuple[Workload, dict[str, Callable[[], Any]], dict[str, str]]:
    """The W4A16 workload of `shape` at `m` rows, and one call each of its dispatched kernel, the bf16
    GEMM's and cuBLAS fp16 on the W4A16 weight's values (with their schedules), on fresh inputs."""
    n, k = SHAPES[shape]
    w4, dense = make_workload("gemm_w4a16", m, n, k), make_workload("gemm", m, n, k)
    fns, scheds = {}, {}
    for label, wl in (("flashgen w4a16", w4), ("flashgen bf16", dense)):
        kern = flashgen.compile(wl, target, db=db)
        ins = {a: v.to(dev) for a, v in wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(3)).items()}
        out = kern.run(ins)
        fns[label], scheds[label] = (lambda kern=kern, ins=ins, out=out: kern.run(ins, out)), str(kern.schedule)
        if wl is w4:
            fns["cuBLAS fp16"], scheds["cuBLAS fp16"] = peer("gemm_w4a16", ins), "torch.matmul"
    return w4, fns, scheds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True, help="tuning database whose records the kernels dispatch")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--idle", type=float, default=1.5, help="seconds idle before each cold timing")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds after the cold and warm timings")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="power_warmup")
    args = ap.parse_args()
    dev = torch.device("cuda")
    target = device_target(dev)
    l2 = target.get("l2_bytes", 1 << 26)
    header = ("shape", "M", "kernel", "cold_us", "cold_card", "warm_us", "warm_card", "warm_over_cold",
              "interleaved_us", "schedule")
    rows = []
    with Database(args.db) as db:
        for shape in args.shapes.split(","):
            w4, fns, scheds = shape_calls(db, target, shape, args.m, dev)
            flush = bytes_moved(w4) > l2 // 2
            timed = {}
            for label, fn in fns.items():
                time.sleep(args.idle)
                cold = gpu_time(fn, dev, flush, l2, power_warmup=False).median_us
                cold_card = card_state()
                warm = gpu_time(fn, dev, flush, l2).median_us
                timed[label] = (cold, cold_card, warm, card_state())
                print(f"{shape:9s} {label:15s} cold {cold:8.1f} us ({cold_card})  warm {warm:8.1f} us "
                      f"({timed[label][3]})", flush=True)
            inter = bench_side_by_side(fns, bytes_moved(w4), l2, rounds=args.rounds)
            for label, (cold, cold_card, warm, warm_card) in timed.items():
                rows.append([shape, args.m, label, cold, cold_card, warm, warm_card, warm / cold, inter[label],
                             scheds[label]])
            del fns
            torch.cuda.empty_cache()
    note = (f"cold: after {args.idle} s idle, 5 ms of warm-up and no power warm-up; warm: after "
            f"{POWER_WARMUP_MS:.0f} ms of back-to-back calls (the default timing); card: SM clock / power / "
            f"temperature read by nvidia-smi right after; interleaved_us: the best median of {args.rounds} "
            "interleaved rounds of warm timings, as gemm.py times side by side.")
    write_results(args.name, header, rows, {**environment(), "target": target.id}, args.out_dir, note)
    print_table(("shape", "kernel", "cold_us", "warm_us", "warm_over_cold", "interleaved_us"),
                [(r[0], r[2], r[3], r[5], r[7], r[8]) for r in rows])


if __name__ == "__main__":
    main()
