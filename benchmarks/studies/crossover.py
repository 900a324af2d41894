"""The mixed compute mode's crossover, replayed on the CPU from GEMM records measured on a GPU: for
each layer shape measured both ways, the fastest W4A16 and W8A8 kernel at each M, and the mode the
runtime's plan (runtime/decoder/mixed.py `estimate`: each mode's GEMM as dispatch would serve it, from the
records of its regime) picks from the same records.

    python benchmarks/studies/crossover.py benchmarks/results/h200_gemm_records.jsonl [--target cuda:sm_90/h200]

W8A8 times are the GEMM's alone: a W8A8 linear also quantizes its activations (one rowwise kernel, a few
microseconds at decode sizes; see rowwise.md), which the choice does not count.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, environment, print_table, replayed_records, write_results  # noqa: E402

from flashgen.db import Database  # noqa: E402
from flashgen.runtime.decoder.mixed import estimate  # noqa: E402
from flashgen.targets import get_target  # noqa: E402
from flashgen.workload import Workload, recorded_workload  # noqa: E402

SHAPE_NAMES = {(8192, 8192): "8192x8192", (6144, 4096): "qkv", (28672, 4096): "gate_up", (4096, 14336): "down",
               (4096, 4096): "o"}


def best_by_shape(db: Database, target: str) -> dict[tuple[int, int], dict[int, dict[str, tuple[float, Workload]]]]:
    """{(N, K): {M: {"w4a16": (us, workload), "w8a8": (us, workload)}}} from the database's fastest correct
    records (of workloads defined today: W4A16 records of an older weight layout measured another kernel)."""
    out: dict[tuple[int, int], dict[int, dict[str, tuple[float, Workload]]]] = {}
    for r in db.best_all(target):
        mode = {"gemm_w4a16": "w4a16", "gemm_w8a8": "w8a8"}.get(r.workload.get("op"))
        wl = recorded_workload(r.workload, r.workload_key) if mode else None
        if wl is None:
            continue
        d = r.workload["dims"]
        per_m = out.setdefault((d["N"], d["K"]), {}).setdefault(d["M"], {})
        per_m[mode] = min(per_m.get(mode, (float("inf"), wl)), (r.latency_us, wl), key=lambda t: t[0])
    return {nk: ms for nk, ms in out.items() if any(len(v) == 2 for v in ms.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path, help="JSON-lines records (flashgen db export)")
    ap.add_argument("--target", default="cuda:sm_90/h200")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    rows, target = [], get_target(args.target)
    with replayed_records(args.records) as (db, path):
        devices = {r.device for r in db.best_all(args.target)}
        for (n, k), per_m in sorted(best_by_shape(db, args.target).items()):
            for m, t in sorted(per_m.items()):
                if len(t) < 2:
                    continue
                us = {mode: v[0] for mode, v in t.items()}
                picks = min(t, key=lambda mode: estimate(t[mode][1], target, path).us)
                rows.append([SHAPE_NAMES.get((n, k), f"{n}x{k}"), m, n, k, us["w4a16"], us["w8a8"],
                             us["w8a8"] / us["w4a16"], min(us, key=us.get), picks])
    meta = environment(", ".join(sorted(devices)) + " (records)")
    write_results("crossover", ("shape", "M", "N", "K", "w4a16_us", "w8a8_us", "w8a8_over_w4a16", "faster",
                                "runtime_picks"), rows, meta, args.out_dir,
                  "Fastest correct record of each mode per workload (GEMM time only: W8A8's activation "
                  "quantization is not counted). runtime_picks: the mode runtime/decoder/mixed.py estimates fastest from these records.")
    print_table(("shape", "M", "w4a16_us", "w8a8_us", "faster", "runtime_picks"),
                [(r[0], r[1], r[4], r[5], r[7], r[8]) for r in rows])


if __name__ == "__main__":
    main()
