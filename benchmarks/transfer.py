"""Cost-model transfer across GPUs, replayed on the CPU: a model trained on one device's records ranks
another device's recorded schedules.

    python benchmarks/transfer.py --train benchmarks/results/h200_gemm_records.jsonl \
        --train benchmarks/results/h200_gluon_int4_records.jsonl --test benchmarks/results/h100_rows_records.jsonl

The model (XGBoost rank objective, `XGBCostModel`) trains on the `--train` records of the test's kernel
class timed alone on any device other than the test's; it never sees the test device (a second model
never sees the test's workloads either). Each test group
(workload, device, timing: alone, or behind one producer) is scored by its own recorded latencies,
which may be timed behind a producer as the decoder runs them: top-k score = best measured latency /
best latency among the k schedules ranked first (1.0: the first k hold the best), and Spearman's
rank correlation of score and speed. Beside it: the analytic prior, and a random order (its top-k
expectation computed exactly; its Spearman is 0 in expectation). The best is the best recorded in the
group, not the space's.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, environment, print_table, write_results  # noqa: E402

from flashgen.db import Database, Record  # noqa: E402
from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.schedules.cost_model import AnalyticPrior, XGBCostModel, samples_from_records  # noqa: E402
from flashgen.targets import get_target  # noqa: E402
from flashgen.workload import recorded_workload  # noqa: E402

KS = (1, 5)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank); nan where either side is constant."""
    ra, rb = (_ranks(np.asarray(x, dtype=np.float64)) for x in (a, b))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=np.float64)
    for v in np.unique(x):  # ties: their mean rank
        tied = x == v
        ranks[tied] = ranks[tied].mean()
    return ranks


def topk(scores: Sequence[float], lats: Sequence[float], k: int) -> float:
    """Best latency / best latency among the k highest-scored schedules."""
    lats = np.asarray(lats, dtype=np.float64)
    top = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")[:k]
    return float(lats.min() / lats[top].min())


def random_topk(lats: Sequence[float], k: int) -> float:
    """The top-k score of a uniformly random order, in expectation: the i-th fastest (0-based) is the
    fastest of k random picks with probability C(n-1-i, k-1) / C(n, k)."""
    lats = np.sort(np.asarray(lats, dtype=np.float64))
    n, k = len(lats), min(k, len(lats))
    return float(sum(math.comb(n - 1 - i, k - 1) / math.comb(n, k) * lats[0] / lats[i] for i in range(n)))


def ranked_groups(records: Sequence[Record], kclass: str | None = None) -> dict[tuple, tuple]:
    """(workload key, target id, timing context) -> (workload, target, schedules, median latencies) of the
    ok records, of one kernel class if given; records of workloads or targets unknown today are left out."""
    raw: dict[tuple, tuple] = {}
    for r in records:
        if r.status != "ok" or r.latency_us is None:
            continue
        wl = recorded_workload(r.workload, r.workload_key)
        if wl is None or (kclass is not None and wl.op.kclass != kclass):
            continue
        try:
            target = get_target(r.target_key)
        except FlashgenError:
            continue
        context = (r.timing, str(r.extra.get("behind")))
        g = raw.setdefault((r.workload_key, r.target_key, context), (wl, target, {}))
        g[2].setdefault(r.schedule_key, (r.schedule, []))[1].append(r.latency_us)
    return {key: (wl, t, [s for s, _ in by.values()], [float(np.median(v)) for _, v in by.values()])
            for key, (wl, t, by) in sorted(raw.items()) if len(by) >= 2}


def evaluate(scorers: dict, groups: dict[tuple, tuple]) -> list[list]:
    """Per scorer (name -> object with `score(wl, schedules, target)`, or None for a random order): the
    mean over groups of top-1 and top-5 scores and of Spearman's correlation of score with speed."""
    rows = []
    for name, scorer in scorers.items():
        acc = defaultdict(list)
        for wl, target, scheds, lats in groups.values():
            if scorer is None:
                for k in KS:
                    acc[k].append(random_topk(lats, k))
                acc["rho"].append(0.0)  # a random order's expectation
                continue
            sc = scorer.score(wl, scheds, target)
            for k in KS:
                acc[k].append(topk(sc, lats, k))
            acc["rho"].append(spearman(sc, [-x for x in lats]))
        rows.append([name, *(float(np.mean(acc[k])) for k in KS), float(np.nanmean(acc["rho"]))])
    return rows


def read_records(paths: Sequence[Path]) -> list[Record]:
    """The records of JSON-lines files, read as `Database.import_jsonl` reads them (a bad line is refused)."""
    out = []
    for p in paths:
        with Database(":memory:") as db:
            db.import_jsonl(p)
            out += db.records()
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=Path, action="append", required=True, help="JSON-lines records to train on")
    ap.add_argument("--test", type=Path, required=True, help="JSON-lines records of the device to rank")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--name", default="transfer")
    args = ap.parse_args(argv)
    test = read_records([args.test])
    kinds = {(wl.op.kclass, r.target_key) for r in test if (wl := recorded_workload(r.workload, r.workload_key))}
    if len({k for k, _ in kinds}) != 1:
        raise SystemExit(f"{args.test}: expected the records of one kernel class, got {sorted(kinds)}")
    kclass, devices = next(iter(kinds))[0], {t for _, t in kinds}
    groups = ranked_groups(test, kclass)
    train = [s for s in samples_from_records(read_records(args.train), kclass) if s[2].id not in devices]
    if not train or not groups:
        raise SystemExit("nothing to train on or nothing to rank: "
                         f"{len(train)} training samples, {len(groups)} test groups of two schedules or more")
    trained_on = sorted({s[2].id for s in train})
    tested = {key for key, _, _ in groups}
    unseen = [s for s in train if s[0].key not in tested]  # the test's workloads on no device either
    scorers = {f"rank model ({', '.join(trained_on)})": XGBCostModel("rank").fit(train)}
    if unseen and len(unseen) < len(train):
        scorers["rank model, the test's workloads held out"] = XGBCostModel("rank").fit(unseen)
    rows = evaluate({**scorers, "analytic prior": AnalyticPrior(), "random order": None}, groups)
    header = ("ranker", "top1", "top5", "spearman")
    sizes = ", ".join(f"{wl} on {t.id} ({c[0]}): {len(s)}" for (_, _, c), (wl, t, s, _) in groups.items())
    note = (f"Trained on {len(train)} {kclass} records timed alone on {', '.join(trained_on)} "
            f"(`{'`, `'.join(p.name for p in args.train)}`); tested on {len(groups)} groups of `{args.test.name}` "
            f"(schedules each: {sizes}). Scores are means over groups; top-k = best measured / best among the k "
            "ranked first; best = best recorded in the group, not the space's; random order: exact expectation "
            "of top-k, Spearman 0 in expectation.")
    command_env = environment(device="CPU replay of recorded GPU measurements")
    write_results(args.name, header, rows, command_env, args.out_dir, note)
    print(note)
    print_table(header, rows)


if __name__ == "__main__":
    main()
