"""Replayed on the CPU: how well the analytic GEMM estimate (schedules/contraction_features.py), which
the search ranks by before a database holds enough records to train the cost model, orders the
schedules each record log measured, per log, beside a random order.

    python benchmarks/studies/prior_quality.py benchmarks/results/h100_rows_records.jsonl ... [--name NAME]

A group is one workload on one target in one timing context (alone, or behind one producer), of at
least --min schedules. Scores, the mean over groups: top-k, the best latency measured over the best
among the k schedules the estimate ranks first (1.0: its first k hold the best); Spearman's correlation
of the estimate's order with the measured speed. Run it at two commits to compare estimates;
--unpack-slots S,S,... scores the estimate at each value of its unpacking cost
(contraction_features.UNPACK_SLOTS, fp32 instruction slots per weight code a matrix tile unpacks).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import RESULTS, environment, print_table, write_results  # noqa: E402
from transfer import evaluate, ranked_groups, read_records  # noqa: E402

from flashgen.schedules import contraction_features  # noqa: E402
from flashgen.schedules.cost_model import AnalyticPrior  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path, nargs="+", help="JSON-lines record logs (flashgen db export)")
    ap.add_argument("--min", type=int, default=4, help="schedules a group needs to count")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--unpack-slots", default=None, help="comma-separated values (default: the module's)")
    ap.add_argument("--name", default="prior_quality")
    args = ap.parse_args()
    slots = [float(x) for x in args.unpack_slots.split(",")] if args.unpack_slots else [contraction_features.UNPACK_SLOTS]
    rows = []
    for path in args.records:
        groups = {k: g for k, g in ranked_groups(read_records([path]), "contraction").items() if len(g[2]) >= args.min}
        for value in slots:
            contraction_features.UNPACK_SLOTS = value
            rows += [[path.name, scorer, value, len(groups), top1, top5, rho]
                     for scorer, top1, top5, rho in evaluate({"analytic estimate": AnalyticPrior()}, groups)]
            print(rows[-1], flush=True)
        rows += [[path.name, "random order", "", len(groups), *evaluate({"random": None}, groups)[0][1:]]]
    header = ("records", "order", "unpack_slots", "groups", "top1", "top5", "spearman")
    write_results(args.name, header, rows, environment(device="CPU replay of recorded GEMM measurements"),
                  args.out_dir, f"Groups of at least {args.min} GEMM schedules measured on one workload, target and "
                  "timing context.")
    print_table(header, rows)


if __name__ == "__main__":
    main()
