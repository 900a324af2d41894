"""How well the cost model ranks GEMM schedules it was not trained on, replayed on the CPU from the
H200 GEMM records: the tuner measures only the model's top few schedules per workload, so this says
how much a short tune can miss.

    python benchmarks/studies/gemm_cost_model.py benchmarks/results/h200_gemm_records.jsonl

Scores are top-k: best recorded latency / best latency among the k schedules the model ranks first
(1.0: the model's first choices hold the best). Splits: workloads held out at random (4 folds, two
random splits), and each row count M held out whole (trained on the other Ms of every shape and op).
Both XGBoost objectives and the analytic prior are scored.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from common import RESULTS, environment, print_table, replayed_records, write_results  # noqa: E402
from search_quality import topk  # noqa: E402

from flashgen.schedules.cost_model import AnalyticPrior, XGBCostModel, compare_objectives, samples_from_records  # noqa: E402

MODELS = ("rank", "regression")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", type=Path, help="JSON-lines records (flashgen db export)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    with replayed_records(args.records) as (db, _):
        samples = samples_from_records(db.records(), "contraction")
    rows = []
    cv = compare_objectives(samples, folds=4, repeats=2)
    for name, score in cv.items():
        rows.append(["random workloads", name, score["top1"], score["top5"], score["groups"]])
    for m in sorted({s[0].dim["M"] for s in samples}):
        train = [s for s in samples if s[0].dim["M"] != m]
        test = [s for s in samples if s[0].dim["M"] == m]
        groups = len({(s[0].key, s[2].id) for s in test})
        for name in MODELS:
            model = XGBCostModel(name).fit(train)
            rows.append([f"M={m} held out", name, topk(model, test, 1), topk(model, test, 5), groups])
        rows.append([f"M={m} held out", "prior", topk(AnalyticPrior(), test, 1), topk(AnalyticPrior(), test, 5), groups])
        print(rows[-3:], flush=True)
    header = ("split", "model", "top1", "top5", "workloads")
    write_results("gemm_cost_model", header, rows, environment(device="CPU replay of H200 records"), args.out_dir,
                  f"{len(samples)} correct GEMM records of `{args.records.name}`.")
    print_table(header, rows)


if __name__ == "__main__":
    main()
