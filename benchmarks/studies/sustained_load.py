"""What a long GEMM's time does under sustained load, beside the card's clocks and power.

Per shape at M rows, for each call of `power_warmup.shape_calls` (the W4A16 GEMM's dispatched kernel,
the bf16 GEMM's, cuBLAS fp16): after `--idle` seconds idle, back-to-back calls for `--seconds`, timed in
windows of about `--window-ms` (CUDA events, one synchronize per window), while nvidia-smi samples the SM
clock, power draw, GPU and memory temperatures and the active clock-event reasons every `--sample-ms`.
The table gives the first window's time per call, the plateau's (the median window after
`--settle-ms`), the plateau side by side with cuBLAS's, and the clocks, power and reasons seen over each
half of the run. `--render` recomputes the table of a saved run (its JSON keeps every window).

    python benchmarks/studies/sustained_load.py --db DB [--shapes gate_up] [--m 4096] [--seconds 3] [--out-dir DIR]
    python benchmarks/studies/sustained_load.py --render benchmarks/results/sustained_load.json --name sustained_load
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, environment, print_table, write_results  # noqa: E402
from power_warmup import shape_calls  # noqa: E402

from flashgen.db import Database  # noqa: E402
from flashgen.targets import device_target  # noqa: E402

FIELDS = ("timestamp", "clocks.sm", "power.draw", "temperature.gpu", "temperature.memory", "clocks_event_reasons.active")
OLD_REASONS = "clocks_throttle_reasons.active"  # the same field under the name older drivers know


class Sampler:
    """nvidia-smi in the background; a thread keeps each sample with nvidia-smi's own time stamp."""

    def __init__(self, sample_ms: int) -> None:
        fields = list(FIELDS)
        if subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv"], capture_output=True).returncode:
            fields[-1] = OLD_REASONS
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                                      f"-lms={sample_ms}"], stdout=subprocess.PIPE, text=True, bufsize=1)
        self.samples: list[tuple[float, list[str]]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            stamp, *values = [v.strip() for v in line.split(",")]
            try:  # "2026/12/01 23:40:00.123", the host's local time
                day, frac = stamp.rsplit(".", 1)
                t = time.mktime(time.strptime(day, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
            except ValueError:
                continue
            self.samples.append((t, values))

    def between(self, t0: float, t1: float) -> list[tuple[float, list[str]]]:
        return [s for s in list(self.samples) if t0 <= s[0] <= t1]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.reader.join(timeout=10)


def sustained(fn: Callable[[], Any], seconds: float, window_ms: float) -> list[tuple[float, float, float]]:
    """(host start, host end, us per call) per window of back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    per_window = max(1, int(window_ms * 1e-3 / max(time.perf_counter() - t0, 1e-6)))
    windows = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    end_at = time.time() + seconds
    while time.time() < end_at:
        h0 = time.time()
        start.record()
        for _ in range(per_window):
            fn()
        stop.record()
        stop.synchronize()
        windows.append((h0, time.time(), start.elapsed_time(stop) * 1e3 / per_window))
    return windows


def _num(v: str) -> float | None:
    try:
        return float(v)
    except ValueError:
        return None


def half_summary(samples: list[tuple[float, list[str]]]) -> str:
    """Median SM clock / power / temperatures and the clock-event reason masks seen, over `samples`."""
    if not samples:
        return "no samples"
    cols = list(zip(*(s for _, s in samples)))
    med = [statistics.median(x) if (x := [n for v in c if (n := _num(v)) is not None]) else "n/a" for c in cols[:4]]
    reasons = sorted(set(cols[4])) if len(cols) > 4 else []
    med = [f"{m:.0f}" if isinstance(m, float) else m for m in med]
    return f"{med[0]} MHz / {med[1]} W / {med[2]} C gpu / {med[3]} C mem / reasons {' '.join(reasons)}"


RAW = ("shape", "M", "kernel", "windows", "first_us", "last_us", "min_us", "max_us", "first_half_card",
       "second_half_card", "schedule", "windows_us")
HEADER = RAW[:6] + ("plateau_us", "plateau_over_first", "plateau_vs_cublas") + RAW[6:]
PEER = "cuBLAS fp16"


def with_plateau(raw: list[dict[str, Any]], seconds: float, settle_ms: float) -> list[list[Any]]:
    """Rows of HEADER: each run's plateau (the median window after the first `settle_ms`, windows being
    of near-equal length), over its first window, and the same shape's cuBLAS plateau over it."""
    def plateau(r: dict[str, Any]) -> float:
        us = [float(u) for u in r["windows_us"].split()]
        return statistics.median(us[min(len(us) - 1, math.ceil(settle_ms * 1e-3 * len(us) / seconds)):])

    peer = {r["shape"]: plateau(r) for r in raw if r["kernel"] == PEER}
    return [[*(r[c] for c in RAW[:6]), plateau(r), plateau(r) / r["first_us"],
             peer[r["shape"]] / plateau(r) if r["shape"] in peer else "", *(r[c] for c in RAW[6:])] for r in raw]


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each kernel of each shape under sustained load: the RAW columns, and the run's environment."""
    dev = torch.device("cuda")
    target = device_target(dev)
    raw = []
    sampler = Sampler(args.sample_ms)
    try:
        with Database(args.db) as db:
            for shape in args.shapes.split(","):
                _, fns, scheds = shape_calls(db, target, shape, args.m, dev)
                for label, fn in fns.items():
                    time.sleep(args.idle)
                    t_start = time.time()
                    wins = sustained(fn, args.seconds, args.window_ms)
                    time.sleep(4 * args.sample_ms * 1e-3)  # the last samples of the run reach the reader
                    mid = (t_start + wins[-1][1]) / 2
                    during = sampler.between(t_start, wins[-1][1])
                    us = [w[2] for w in wins]
                    raw.append(dict(zip(RAW, (shape, args.m, label, len(wins), us[0], us[-1], min(us), max(us),
                                              half_summary([s for s in during if s[0] < mid]),
                                              half_summary([s for s in during if s[0] >= mid]), scheds[label],
                                              " ".join(f"{u:.0f}" for u in us)))))
                    print(f"{shape:8s} {label:15s} first {us[0]:8.1f} us  last {us[-1]:8.1f} us  "
                          f"({raw[-1]['first_half_card']} -> {raw[-1]['second_half_card']})", flush=True)
                del fns
                torch.cuda.empty_cache()
    finally:
        sampler.close()
    return raw, {**environment(), "target": target.id, "seconds": args.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="tuning database whose records the kernels dispatch")
    ap.add_argument("--render", type=Path, help="a JSON result of this script: recompute its table, no GPU")
    ap.add_argument("--shapes", default="gate_up")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--idle", type=float, default=3.0, help="seconds idle before each kernel's run")
    ap.add_argument("--seconds", type=float, default=3.0, help="seconds of back-to-back calls per kernel")
    ap.add_argument("--window-ms", type=float, default=50.0)
    ap.add_argument("--settle-ms", type=float, default=300.0, help="windows before the plateau")
    ap.add_argument("--sample-ms", type=int, default=20)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="sustained_load")
    args = ap.parse_args()
    if args.render:
        saved = json.loads(args.render.read_text())
        raw = [dict(zip(saved["columns"], r)) for r in saved["rows"]]
        meta = {**saved["meta"], "rendered": environment("(rendered, no GPU)")["command"]}
    elif args.db:
        raw, meta = measure(args)
    else:
        ap.error("give --db (measure on the GPU) or --render (a saved run)")
    rows = with_plateau(raw, meta.get("seconds", args.seconds), args.settle_ms)  # a saved run's own length
    note = (f"After {args.idle} s idle, {args.seconds} s of back-to-back calls timed in windows of about "
            f"{args.window_ms:.0f} ms (one synchronize per window). plateau: the median window after the first "
            f"{args.settle_ms:.0f} ms; plateau_vs_cublas: cuBLAS fp16's plateau over this one (above 1: faster). "
            f"card: medians of nvidia-smi's samples every {args.sample_ms} ms during each half (SM clock, power, "
            "GPU and memory temperature) and the clock-event reason masks seen (0x0: none; 0x1 idle, 0x4 "
            "software power cap, 0x8 hardware slowdown, 0x20 software thermal, 0x40 hardware thermal, 0x80 "
            "hardware power brake).")
    write_results(args.name, HEADER, rows, meta, args.out_dir, note)
    print_table(("shape", "kernel", "first_us", "plateau_us", "plateau_over_first", "plateau_vs_cublas"),
                [(r[0], r[2], r[4], r[6], r[7], r[8]) for r in rows])


if __name__ == "__main__":
    main()
