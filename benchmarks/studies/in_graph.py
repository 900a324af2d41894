"""Recorded schedules of decode-step GEMVs timed alone, as the tuner times them, and behind a producer
kernel in a CUDA graph, as a decode step runs them.

In a decode step each GEMV is launched right behind the kernel that writes its input, with
programmatic dependent launch: its programs start while that kernel still runs, and an early-load
schedule fetches its first weights before it waits. The tuner times a candidate alone (the L2 flushed,
CUDA events around one call) and cannot see that overlap, and its ranking has disagreed with the
decoder's (docs/findings.md: fused bf16 GEMVs tuned alone, 231 tokens/s, against 239 with the plain forms'
early-load schedules). Here a workload's fastest records timed alone, plus the best one of each `early_load` value,
are timed both ways. Behind a producer: a CUDA graph of (L2 flush, producer, candidate) triples against
one of (L2 flush, producer) pairs, the difference per triple being the candidate's cost in the graph.
The producer is an RMSNorm whose output's first rows are the candidate's input, of `rows` rows of a
4096-wide activation (as many bytes for a wider one): one row is a short latency-bound kernel on one
SM (as decode attention leaves the SMs idle before the o projection), 8192 rows a bandwidth-bound one
(as a GEMV before the next layer's).

    python benchmarks/studies/in_graph.py --db DB [--workloads FILE] [--top 6] [--rows 1,8192] [--rounds 5]
        [--name in_graph] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, environment, print_table, write_results  # noqa: E402

import flashgen  # noqa: E402
from flashgen.db import Database  # noqa: E402
from flashgen.db.record import ALONE  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.schedules.timing import behind_cost, gpu_time  # noqa: E402
from flashgen.targets import device_target  # noqa: E402
from flashgen.workload import read_workloads  # noqa: E402

# The bf16 batch-1 decoder's GEMVs of one layer, with the norm or gate fused as it dispatches them.
DECODE_B1 = [
    ("rmsnorm_gemm", {"M": 1, "N": 6144, "K": 4096}, {}),
    ("gemm", {"M": 1, "N": 4096, "K": 4096}, {"with_residual": "yes"}),
    ("rmsnorm_gemm", {"M": 1, "N": 28672, "K": 4096}, {}),
    ("silu_mul_gemm", {"M": 1, "N": 4096, "K": 14336}, {"with_residual": "yes"}),
]


def candidates(records: list[Any], space: ScheduleSpace, top: int) -> list[tuple[dict, float]]:
    """The `top` fastest distinct schedules of a workload's correct records, then the fastest of each
    early_load value not among them, as (complete schedule, recorded us), fastest first."""
    best: dict[str, tuple[dict, float]] = {}
    for r in records:
        s = space.complete(r.schedule)
        key = json.dumps(s, sort_keys=True)
        if r.latency_us is not None and (key not in best or r.latency_us < best[key][1]):
            best[key] = (s, r.latency_us)
    ranked = sorted(best.values(), key=lambda v: v[1])
    chosen = ranked[:top]
    early = lambda s: space.flat(s)["early_load"]  # noqa: E731 (an option of GEMV variants)
    for value in sorted({early(s) for s, _ in ranked}):
        if not any(early(s) == value for s, _ in chosen):
            chosen.append(next(v for v in ranked if early(v[0]) == value))
    return sorted(chosen, key=lambda v: v[1])


def ranks(values: list[float]) -> list[int]:
    """1 for the smallest value, ties in order of appearance."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0] * len(values)
    for place, i in enumerate(order, 1):
        out[i] = place
    return out


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two timings of the same candidates (1: same order)."""
    n = len(a)
    if n < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--workloads", type=Path, help="JSON lines of {op, dims, attrs} (default: the bf16 batch-1 decoder's GEMVs)")
    ap.add_argument("--top", type=int, default=6, help="fastest recorded schedules per workload")
    ap.add_argument("--rows", default="1,8192", help="producer rows (RMSNorm) to time behind")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="in_graph")
    args = ap.parse_args()
    dev = torch.device("cuda")
    target = device_target(dev)
    l2 = int(target.get("l2_bytes"))
    rows_list = [int(r) for r in args.rows.split(",")]
    wls = (read_workloads(str(args.workloads)) if args.workloads
           else [flashgen.workload(op, **dims, dtype="bf16", **attrs) for op, dims, attrs in DECODE_B1])
    header = ("workload", "schedule", "recorded_us", "alone_us", *(f"behind_{r}_us" for r in rows_list),
              "rank_alone", *(f"rank_behind_{r}" for r in rows_list))
    rows, summary = [], []
    t0 = time.perf_counter()
    with Database(args.db) as db:
        for wl in wls:
            space = ScheduleSpace(wl, target)
            chosen = candidates([r for r in db.records(wl.key, target.id, status="ok") if r.timing == ALONE],
                                space, args.top)
            if not chosen:
                print(f"{wl}: no records", flush=True)
                continue
            gen = torch.Generator().manual_seed(5)
            ins = {k: v.to(dev) for k, v in wl.op.make_inputs(wl.dim, wl.attr, gen).items()}
            act = wl.inputs[0].name  # the input a producer writes, as in `flashgen tune --behind`
            width = ins[act].shape[1]
            producers = {}
            for r in rows_list:  # rows of a 4096-wide activation: as many bytes for wider ones
                prows = max(r * 4096 // width, ins[act].shape[0], 1)
                pwl = flashgen.workload("rmsnorm", M=prows, N=width, dtype=wl.attr.get("dtype", "bf16"))
                pk = flashgen.compile(pwl, target, db=db)
                pins = {k: v.to(dev) for k, v in pwl.op.make_inputs(pwl.dim, pwl.attr, gen).items()}
                pout = pk.run(pins)
                producers[r] = (lambda pk=pk, pins=pins, pout=pout: pk.run(pins, pout)), pout["y"]
            times = []
            for s, rec in chosen:
                if not space.is_valid(s):
                    print(f"  {short(s)}: {space.why_invalid(s)}; skipped", flush=True)
                    continue
                kern = flashgen.compile(wl, target, schedule=s)
                out = kern.run(ins)
                alone = gpu_time(lambda: kern.run(ins, out), dev, True, l2, runs=30).median_us
                behind = []
                for r in rows_list:
                    produce, y = producers[r]
                    fed = {**ins, act: y[: ins[act].shape[0]]}  # the producer's output is the call's input
                    behind.append(behind_cost(lambda fed=fed: kern.run(fed, out), produce, dev, l2, args.rounds).median_us)
                times.append((s, rec, alone, behind))
                print(f"{wl.op_name} N={wl.dim['N']} K={wl.dim['K']} {short(s)}: recorded {rec:.2f} alone {alone:.2f} "
                      f"behind {' / '.join(f'{b:.2f}' for b in behind)} us ({time.perf_counter() - t0:.0f}s)", flush=True)
            alone_ranks = ranks([t[2] for t in times])
            behind_ranks = [ranks([t[3][j] for t in times]) for j in range(len(rows_list))]
            for i, (s, rec, alone, behind) in enumerate(times):
                rows.append([str(wl), short(s), rec, alone, *behind, alone_ranks[i], *(br[i] for br in behind_ranks)])
            summary.append([str(wl), len(times), *(spearman([t[2] for t in times], [t[3][j] for t in times])
                                                   for j in range(len(rows_list)))])
            write_results(args.name, header, rows, {**environment(), "target": target.id, "rows": rows_list,
                                                    "spearman": summary}, args.out_dir, NOTE)
    print_table(("workload", "schedule", "alone_us", *(f"behind_{r}" for r in rows_list)),
                [(r[0][:40], r[1], r[3], *r[4:4 + len(rows_list)]) for r in rows])
    print_table(("workload", "candidates", *(f"spearman_{r}" for r in rows_list)), [(s[0][:40], *s[1:]) for s in summary])


NOTE = ("alone_us: one call with the L2 flushed before it, CUDA events (the tuner's timing). behind_R_us: the "
        "call's cost in a CUDA graph right after an RMSNorm of R rows that writes its input (programmatic "
        "dependent launch), each triple (L2 flush, RMSNorm, call) against the pair without the call; median "
        "of the rounds' differences of medians. Ranks: 1 is fastest. The metadata's spearman lists, per workload, "
        "the rank correlation of alone_us with each behind_R_us.")


def short(s: dict) -> str:
    """The knobs a GEMV tile's schedule varies, compactly."""
    return (f"{s['block_m']}x{s['block_n']}x{s['block_k']} w{s['num_warps']} st{s['num_stages']}"
            f" g{s['group_m']} early{s.get('early_load', 0)} split{s.get('split_k', 1)}"
            + (f" ptx{s['ptx_unpack']}" if s.get("ptx_unpack") else ""))


if __name__ == "__main__":
    main()
