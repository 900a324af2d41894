"""Search quality and cost-model accuracy, replayed on the CPU from recorded GPU measurements.

    python benchmarks/search_quality.py benchmarks/results/h200_tuning_records.jsonl
    python benchmarks/search_quality.py benchmarks/results/h200_attention_records.jsonl --fix early_kv=0 \
        --name search_quality_attention

For each workload of the exhaustive sweep, the recorded latency of every schedule stands in for the
GPU. Reported, median over 5 seeds: measurements that evolutionary search (guided by a cost model
trained on the other workloads) and random search need to come within 3% of the exhaustive best,
against the size of the space. Then the cost model on shapes it never saw: top-1 / top-5 score (best
latency / best latency among the model's k top-ranked schedules) for both XGBoost objectives and the
analytic prior, with workloads held out at random and with whole hidden sizes held out (where the
records hold both N = 4096 and N = 8192). `--fix` replays the subspace with a knob pinned (records
that predate the knob read as its neutral value), for sweeps made before the knob existed.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, print_table, replayed_records  # noqa: E402

from flashgen.schedules.cost_model import (AnalyticPrior, XGBCostModel, compare_objectives,  # noqa: E402
                                           samples_from_records)
from flashgen.schedules.replay import best_of, measurements_to_within, replay, table_from_records  # noqa: E402
from flashgen.schedules.search import make_strategy  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.targets import get_target  # noqa: E402
from flashgen.workload import Workload  # noqa: E402

SEEDS = range(5)


def topk(model, samples, k: int) -> float:
    """Mean over workloads of best latency / best latency among the model's top-k."""
    groups = defaultdict(list)
    for wl, s, t, lat in samples:
        groups[(wl.key, t.id)].append((wl, s, t, lat))
    scores = []
    for rows in groups.values():
        wl, t = rows[0][0], rows[0][2]
        pred = np.asarray(model.score(wl, [r[1] for r in rows], t))
        lats = np.asarray([r[3] for r in rows])
        top = np.argsort(-pred)[:k]
        scores.append(lats.min() / lats[top].min())
    return float(np.mean(scores))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", help="JSON-lines export of the sweep's database")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="search_quality", help="result files: <out-dir>/<name>.json and .md")
    ap.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                    help="replay the subspace with this knob pinned (repeatable)")
    args = ap.parse_args()
    fixed = tuple((k, int(v)) for k, _, v in (f.partition("=") for f in args.fix))
    with replayed_records(args.records) as (db, _):
        records = db.records()
    by_wl = defaultdict(list)
    for r in records:
        by_wl[(r.workload_key, r.target_key)].append(r)
    samples = samples_from_records([r for r in records if r.status == "ok"])
    rows = []
    for (wkey, tid), recs in sorted(by_wl.items(), key=lambda kv: str(Workload.from_json(kv[1][0].workload))):
        wl, target = Workload.from_json(recs[0].workload), get_target(tid)
        pinned = tuple((k, v) for k, v in fixed if k in ScheduleSpace(wl, target).knobs())  # where the space has it
        space = ScheduleSpace(wl, target, fixed=pinned)
        full = [dataclasses.replace(r, schedule=space.complete(r.schedule)) for r in recs]
        table = table_from_records([r for r in full if all(r.schedule.get(k) == v for k, v in pinned)])
        size = len(list(space))
        if len(table) < size:
            continue  # not an exhaustive sweep of this workload
        best = best_of(table)
        others = [s for s in samples if s[0].key != wkey]
        model = XGBCostModel("rank").fit(others)
        evo, rnd = [], []
        for seed in SEEDS:
            lat = replay(make_strategy("evolutionary", space, model, seed), table, batch=8, until=best * 1.03)
            evo.append(measurements_to_within(lat, best))
            lat = replay(make_strategy("random", space, None, seed), table, batch=8, until=best * 1.03)
            rnd.append(measurements_to_within(lat, best))
        e, r = statistics.median(evo), statistics.median(rnd)
        rows.append([str(wl), size, e, r, e / size, r / e])
        print(f"{str(wl):58s} space {size:4d}  evolutionary {e:5.1f}  random {r:6.1f}", flush=True)
    header = ("workload", "space", "evolutionary_to_3pct", "random_to_3pct", "evolutionary_fraction_of_space",
              "random_over_evolutionary")
    med_e = statistics.median(r[2] for r in rows)
    med_r = statistics.median(r[3] for r in rows)
    worst_frac = max(r[4] for r in rows)
    ratio_all = sum(r[3] for r in rows) / sum(r[2] for r in rows)
    summary = [["all workloads (median)", statistics.median(r[1] for r in rows), med_e, med_r,
                statistics.median(r[4] for r in rows), med_r / med_e],
               ["all workloads (worst fraction / total ratio)", max(r[1] for r in rows),
                max(r[2] for r in rows), max(r[3] for r in rows), worst_frac, ratio_all]]
    # The cost model on unseen shapes.
    cv = compare_objectives(samples, folds=4, repeats=2)
    n4096 = [s for s in samples if s[0].dim.get("N", s[0].dim.get("Hq", 0) * 128) == 4096]
    n8192 = [s for s in samples if s[0].dim.get("N", s[0].dim.get("Hq", 0) * 128) == 8192]
    nan = (float("nan"), float("nan"))
    split = {name: nan for name in ("rank", "regression", "prior")}
    if n4096 and n8192:
        for name in ("rank", "regression"):
            m = XGBCostModel(name).fit(n4096)
            split[name] = (topk(m, n8192, 1), topk(m, n8192, 5))
        split["prior"] = (topk(AnalyticPrior(), n8192, 1), topk(AnalyticPrior(), n8192, 5))
    model_rows = [[name, cv[name]["top1"], cv[name]["top5"], split[name][0], split[name][1]]
                  for name in ("rank", "regression", "prior")]
    command = " ".join([args.records] + [f"--fix {f}" for f in args.fix]
                       + ([f"--name {args.name}"] if args.name != "search_quality" else []))
    write_md(args.out_dir, args.name, rows + summary, header, model_rows, command, len(by_wl) - 1)
    print_table(header, summary)
    print_table(("model", "heldout_top1", "heldout_top5", "N8192_top1", "N8192_top5"), model_rows)


def write_md(out_dir: Path, name: str, rows, header, model_rows, command: str, others: int) -> None:
    import json

    from common import _fmt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(
        {"search": {"columns": list(header), "rows": rows},
         "cost_model": {"columns": ["model", "heldout_top1", "heldout_top5", "N8192_top1", "N8192_top5"],
                        "rows": model_rows}}, indent=1) + "\n")
    lines = ["# search quality (replayed from H200 measurements)", "",
             f"Command: `python benchmarks/search_quality.py {command}` (CPU only)", "",
             "Measurements needed to come within 3% of the exhaustive best, median over 5 seeds, batches of 8. "
             "evolutionary = evolutionary search ranked by an XGBoost rank model trained on the other "
             f"{others} workloads; random = uniform random search. A count of space+1 means never.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in rows]
    lines += ["", "Cost model on unseen shapes: top-k score = best latency / best latency among the model's k "
              "top-ranked schedules (1.0 = the model's top k hold the best). heldout = 4 folds of workloads "
              "held out at random, 2 repeats; N8192 = trained on every N=4096 workload, tested on N=8192 (nan where "
              "the records lack either).", "",
              "| model | heldout_top1 | heldout_top5 | N8192_top1 | N8192_top5 |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(_fmt(v) for v in r) + " |" for r in model_rows]
    (out_dir / f"{name}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
