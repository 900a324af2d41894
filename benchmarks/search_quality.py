"""Search quality and cost-model accuracy, replayed on the CPU from recorded GPU measurements.

    python benchmarks/search_quality.py benchmarks/results/h200_tuning_records.jsonl
    python benchmarks/search_quality.py benchmarks/results/h200_attention_records.jsonl --fix early_kv=0 \
        --name search_quality_attention
    python benchmarks/search_quality.py benchmarks/results/h200_gemm_records.jsonl --recorded \
        --name search_quality_gemm

For each workload of the exhaustive sweep, the recorded latency of every schedule stands in for the
GPU. Reported, median over 5 seeds: measurements that evolutionary search (guided by a cost model
trained on the other workloads) and random search need to come within 3% of the exhaustive best,
against the size of the space, counted in three protocols (PROTOCOLS): the strategy alone in batches
of 8 (the earlier tables' count), and the tuner itself (`replay.replay_tune`: the analytic default
first, then the tuner's batches, its cost model trained on the other workloads' records of the class),
to the measurement and to the end of its batch. Then the cost model on shapes it never saw: top-1 /
top-5 score (best latency / best latency among the model's k top-ranked schedules) for both XGBoost
objectives and the analytic prior, with workloads held out at random and with whole hidden sizes held
out (where the records hold both N = 4096 and N = 8192). `--fix` replays the subspace with a knob
pinned (records that predate the knob read as its neutral value), for sweeps made before the knob
existed. `--recorded` replays each workload within the schedules its records hold (a GEMM space is
never swept: up to 10^5 valid schedules), its "best" the best recorded; without it, a space too large
to enumerate is skipped without being walked.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, print_table, replayed_records  # noqa: E402

from flashgen.db import Database  # noqa: E402
from flashgen.db.record import schedule_key  # noqa: E402
from flashgen.schedules.cost_model import (AnalyticPrior, CostModel, XGBCostModel, compare_objectives,  # noqa: E402
                                           model_path, samples_from_records, sidecar_path)
from flashgen.schedules.features import feature_names  # noqa: E402
from flashgen.schedules.replay import (RecordedSpace, best_of, measurements_to_within, replay,  # noqa: E402
                                       replay_tune, table_from_records)
from flashgen.schedules.search import ENUMERATE_LIMIT, make_strategy  # noqa: E402
from flashgen.schedules.space import ScheduleSpace  # noqa: E402
from flashgen.schedules.tuner import BATCH  # noqa: E402
from flashgen.targets import get_target  # noqa: E402
from flashgen.workload import Workload, recorded_workload  # noqa: E402

SEEDS = range(5)
PLAIN_BATCH = 8
PROTOCOLS = {
    "plain": f"the strategy alone in batches of {PLAIN_BATCH}, the default not measured, counted to the "
             "measurement that came within 3% (the earlier tables' count)",
    "tuner": f"the tuner's own loop (tuner.tune with a replay Runner): the analytic default first, then batches "
             f"of {BATCH}, counted to the measurement that came within 3%",
    "paid": f"the tuner's loop counted to the end of that batch of {BATCH}: what a tune measures before it can "
            "stop (it learns, and stops, only between batches)",
}
STRATEGIES = ("evolutionary", "random")


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


def tuner_counts(wl: Workload, space: ScheduleSpace, table: dict, best: float, others: list,
                 tmp: Path) -> dict[str, tuple[list[int], list[int]]]:
    """Per strategy, over SEEDS: measurements to within 3% of `best` by the tuner's loop, to the
    measurement and to the end of its batch. Each tune gets a fresh copy of one database of `others`
    (the other workloads' records) and of the cost model trained on it, so no replay sees another's."""
    base = tmp / f"{wl.key}.db"
    with Database(base) as db:
        db.add_many(others)
    CostModel.for_database(base, wl.op.kclass)  # trained once, saved beside `base`
    out: dict[str, tuple[list[int], list[int]]] = {}
    for strategy in STRATEGIES:
        to, paid = [], []
        for seed in SEEDS:
            run = tmp / f"{wl.key}-{strategy}-{seed}.db"
            for src, dst in ((base, run), (model_path(base, wl.op.kclass), model_path(run, wl.op.kclass))):
                if src.exists():
                    shutil.copyfile(src, dst)
                    if dst != run:
                        shutil.copyfile(sidecar_path(src), sidecar_path(dst))
            with Database(run) as db:
                tuned = replay_tune(space, db, table, strategy, seed, until=best * 1.03)
            to.append(measurements_to_within(tuned.latencies, best))
            paid.append(tuned.paid_to_within(best))
        out[strategy] = (to, paid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", help="JSON-lines export of the sweep's database")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="search_quality", help="result files: <out-dir>/<name>.json and .md")
    ap.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                    help="replay the subspace with this knob pinned (repeatable)")
    ap.add_argument("--recorded", action="store_true",
                    help="replay each workload within the schedules its records hold (best = best recorded)")
    ap.add_argument("--min-recorded", type=int, default=2 * BATCH, metavar="N",
                    help="with --recorded, replay only workloads with at least N recorded schedules "
                         "(default: two of the tuner's batches)")
    args = ap.parse_args()
    fixed = tuple((k, int(v)) for k, _, v in (f.partition("=") for f in args.fix))
    with replayed_records(args.records) as (db, _):
        records = db.records()
    by_wl = defaultdict(list)
    for r in records:
        by_wl[(r.workload_key, r.target_key)].append(r)
    samples = samples_from_records([r for r in records if r.status == "ok"])
    rows, skipped, unrecorded_default, classes = [], Counter(), 0, Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for (wkey, tid), recs in sorted(by_wl.items(), key=lambda kv: str(Workload.from_json(kv[1][0].workload))):
            wl, target = recorded_workload(recs[0].workload, wkey), get_target(tid)
            if wl is None:  # its op changed since (a new attribute): these records measured another kernel
                skipped["recorded under a workload key of an earlier version"] += 1
                continue
            pinned = tuple((k, v) for k, v in fixed if k in ScheduleSpace(wl, target).knobs())  # where the space has it
            space = ScheduleSpace(wl, target, fixed=pinned)
            full = [dataclasses.replace(r, schedule=space.complete(r.schedule)) for r in recs]
            table = table_from_records([r for r in full if all(r.schedule.get(k) == v for k, v in pinned)])
            if not any(v is not None for v in table.values()):
                skipped["no successful record"] += 1
                continue
            if args.recorded:
                space = RecordedSpace.of(space, [r.schedule for r in full if r.schedule_key in table])
                if len(space.recorded) < args.min_recorded:
                    skipped[f"fewer than {args.min_recorded} recorded schedules"] += 1
                    continue
                default_key = schedule_key(space.pinned_default())
                if default_key not in table:  # measured first by the tuner, its latency unknown: a miss
                    unrecorded_default += 1
                    table = {**table, default_key: None}
                size = len(space.recorded)
            else:
                if space.raw_size() > ENUMERATE_LIMIT:
                    skipped["space too large to enumerate (replay it with --recorded)"] += 1
                    continue
                size = sum(1 for _ in space)
                if len(table) < size:
                    skipped["not an exhaustive sweep"] += 1
                    continue
            best = best_of(table)
            # (the old count's model: trained on the other workloads of every class with these features)
            names = feature_names(wl.op.kclass)
            model = XGBCostModel("rank").fit([s for s in samples if s[0].key != wkey
                                              and feature_names(s[0].op.kclass) == names])
            plain: dict[str, list[int]] = {name: [] for name in STRATEGIES}
            for seed in SEEDS:
                for name in STRATEGIES:
                    strat = make_strategy(name, space, model if name == "evolutionary" else None, seed)
                    lat = replay(strat, table, batch=PLAIN_BATCH, until=best * 1.03)
                    plain[name].append(measurements_to_within(lat, best))
            others = [r for r in records if r.workload_key != wkey]
            tuned = tuner_counts(wl, space, table, best, others, Path(tmp))
            med = {name: statistics.median(plain[name]) for name in STRATEGIES}
            t = {name: statistics.median(tuned[name][0]) for name in STRATEGIES}
            p = {name: statistics.median(tuned[name][1]) for name in STRATEGIES}
            rows.append([str(wl), size, med["evolutionary"], med["random"], t["evolutionary"], t["random"],
                         p["evolutionary"], p["random"], p["random"] / p["evolutionary"]])
            classes[wl.op.kclass] += 1
            print(f"{str(wl):58s} {size:4d}  plain {med['evolutionary']:5.1f} / {med['random']:5.1f}  tuner "
                  f"{t['evolutionary']:5.1f} / {t['random']:5.1f}  paid {p['evolutionary']:5.1f} / {p['random']:5.1f}",
                  flush=True)
    if not rows:
        raise SystemExit(f"no workload of {args.records} could be replayed ({dict(skipped)})")
    header = ("workload", "space", "evolutionary_plain", "random_plain", "evolutionary_tuner", "random_tuner",
              "evolutionary_paid", "random_paid", "random_over_evolutionary_paid")
    cols = list(zip(*rows))
    summary = [["all workloads (median)"] + [statistics.median(c) for c in cols[1:8]]
               + [statistics.median(cols[7]) / statistics.median(cols[6])],
               ["all workloads (sum)"] + [sum(c) for c in cols[1:8]] + [sum(cols[7]) / sum(cols[6])]]
    ratios = {proto: sum(cols[2 * i + 3]) / sum(cols[2 * i + 2]) for i, proto in enumerate(PROTOCOLS)}
    # The cost model on unseen shapes (the most replayed class's records, and those sharing its features).
    names = feature_names(classes.most_common(1)[0][0])
    samples = [s for s in samples if feature_names(s[0].op.kclass) == names]
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
    command = " ".join([args.records] + [f"--fix {f}" for f in args.fix] + ["--recorded"] * args.recorded
                       + ([f"--min-recorded {args.min_recorded}"] if args.recorded and args.min_recorded != 2 * BATCH else [])
                       + ([f"--name {args.name}"] if args.name != "search_quality" else []))
    notes = {"ground_truth": ("the best recorded schedule of each workload, not the space's: no sweep covers these "
                              f"spaces; the space column counts the recorded schedules (and the default); "
                              f"{unrecorded_default} workloads' analytic default has no record and counts as a "
                              "measurement that found nothing") if args.recorded
                             else "the exhaustive best: every valid schedule of each workload is recorded",
             "skipped": dict(skipped), "random_over_evolutionary_sum": ratios}
    write_md(args.out_dir, args.name, rows + summary, header, model_rows, command, notes)
    print_table(header, summary)
    print("random / evolutionary, summed over workloads: "
          + ", ".join(f"{proto} {r:.3g}" for proto, r in ratios.items()))
    print_table(("model", "heldout_top1", "heldout_top5", "N8192_top1", "N8192_top5"), model_rows)


def write_md(out_dir: Path, name: str, rows, header, model_rows, command: str, notes: dict) -> None:
    import json

    from common import _fmt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(
        {"protocols": PROTOCOLS, **notes,
         "search": {"columns": list(header), "rows": rows},
         "cost_model": {"columns": ["model", "heldout_top1", "heldout_top5", "N8192_top1", "N8192_top5"],
                        "rows": model_rows}}, indent=1) + "\n")
    skipped = "; ".join(f"{n} {why}" for why, n in notes["skipped"].items()) or "none"
    lines = ["# search quality (replayed from recorded GPU measurements)", "",
             f"Command: `python benchmarks/search_quality.py {command}` (CPU only)", "",
             f"Measurements needed to come within 3% of the best, median over {len(SEEDS)} seeds. Best: "
             f"{notes['ground_truth']}. evolutionary = evolutionary search ranked by an XGBoost rank model "
             "trained on the other workloads; random = uniform random search. A count of space+1 means never. "
             f"Workloads not replayed: {skipped}.", "",
             "Protocols (each count's column suffix):", ""]
    lines += [f"- `{proto}`: {text}." for proto, text in PROTOCOLS.items()]
    lines += ["", "random / evolutionary, summed over workloads: "
              + ", ".join(f"{proto} {_fmt(r)}" for proto, r in notes["random_over_evolutionary_sum"].items()), "",
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
