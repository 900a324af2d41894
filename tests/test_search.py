"""Search strategies replayed against synthetic latency tables (see test_cost_model.py): no GPU needed."""
from __future__ import annotations

import numpy as np
import pytest

from flashgen.db import Record
from flashgen.db.record import schedule_key
from flashgen.errors import FlashgenError
from flashgen.schedules import search as search_mod
from flashgen.schedules.cost_model import DEFAULT_OBJECTIVE, AnalyticPrior, CostModel, XGBCostModel
from flashgen.schedules.replay import best_of, measurements_to_within, replay, table_from_records
from flashgen.schedules.search import (Evolutionary, Exhaustive, RandomSearch, SearchStrategy,
                                       make_strategy)
from flashgen.schedules.space import ScheduleSpace
from flashgen.workload import workload
from tests.test_cost_model import (H200, MI300X, TARGETS, synthetic_samples, synthetic_table,
                                   synthetic_workloads)

WORKLOADS = synthetic_workloads()
HELD_OUT = WORKLOADS[1::4]                   # the evolutionary test tunes these ...
TRAIN = [w for w in WORKLOADS if w not in HELD_OUT]   # ... with a model that never saw them


@pytest.fixture(scope="module")
def model():
    return XGBCostModel(DEFAULT_OBJECTIVE, num_rounds=80).fit(synthetic_samples(TRAIN))


class Recorder(SearchStrategy):
    """Wraps a strategy, keeping every proposal."""

    def __init__(self, inner: SearchStrategy) -> None:
        self.inner, self.proposed = inner, []

    def propose(self, n):
        out = self.inner.propose(n)
        assert len(out) <= n
        self.proposed += out
        return out

    def observe(self, results):
        self.inner.observe(results)


def _keys(schedules):
    return [schedule_key(s) for s in schedules]


def test_exhaustive_visits_every_valid_schedule_once_in_a_fixed_order():
    wl = workload("rmsnorm", M=512, N=5120, dtype="bf16")
    space = ScheduleSpace(wl, H200)
    table = synthetic_table(wl, H200)
    runs = []
    for batch in (1, 7, 64):
        rec = Recorder(Exhaustive(space))
        lats = replay(rec, table, batch=batch)
        assert len(lats) == len(table) and len(rec.proposed) == len(table)
        assert sorted(_keys(rec.proposed)) == sorted(table)   # every valid schedule, each once
        assert rec.inner.propose(5) == []                        # then nothing
        runs.append(_keys(rec.proposed))
    assert runs[0] == runs[1] == runs[2]
    # the prior's order: its first pick is the analytic favourite
    prior = AnalyticPrior().score(wl, [dict(s) for s in space], H200)
    assert runs[0][0] == schedule_key(list(space)[int(np.argmax(prior))])


@pytest.mark.parametrize("name", ["exhaustive", "random", "evolutionary", "evolutionary-refit"])
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.device)
def test_no_strategy_proposes_a_measured_or_invalid_schedule(name, target, model):
    wl = workload("layernorm", M=1000, N=4096, dtype="fp16")
    space = ScheduleSpace(wl, target)
    table = synthetic_table(wl, target)
    valid = list(space)
    rng = np.random.default_rng(3)
    earlier = [valid[i] for i in rng.choice(len(valid), 15, replace=False)]
    measured = [(s, None if i % 4 == 0 else table[schedule_key(s)]) for i, s in enumerate(earlier)]
    bogus = {"block_r": 1, "block_c": 16, "num_warps": 32}       # invalid: an earlier version's schedule
    assert not space.is_valid(bogus)
    measured.append((bogus, 1.0))
    failed = set(_keys(valid[i] for i in range(0, len(valid), 9)))   # these fail when measured
    table = {k: (None if k in failed else v) for k, v in table.items()}
    kw = {"refit": True} if name.endswith("refit") else {}
    strategy = make_strategy(name.split("-")[0], space, model, seed=1, measured=measured, **kw)
    rec = Recorder(strategy)
    lats = []
    for batch in (1, 3, 8, 5, 16) * 100:
        out = rec.propose(batch)
        if not out:
            break
        results = [(s, table[schedule_key(s)]) for s in out]
        rec.observe(results)
        lats += [lat for _, lat in results]
    keys = _keys(rec.proposed)
    assert all(space.is_valid(s) for s in rec.proposed)
    assert len(keys) == len(set(keys))                                   # never twice
    assert not set(keys) & set(_keys(s for s, _ in measured))            # never what was measured
    assert set(keys) | set(_keys(earlier)) == set(table)                 # and, in the end, all the rest
    assert best_of(table) in lats + [lat for _, lat in measured]


@pytest.mark.parametrize("cls", [RandomSearch, Evolutionary])
def test_large_space_paths_propose_valid_unseen_schedules(cls, monkeypatch, model):
    """Spaces too large to enumerate are sampled; the guarantees hold there too."""
    monkeypatch.setattr(search_mod, "ENUMERATE_LIMIT", 0)
    monkeypatch.setattr(search_mod, "RANK_ALL_LIMIT", 16)
    wl = workload("silu_mul", M=300, N=11008)
    space = ScheduleSpace(wl, H200)
    table = synthetic_table(wl, H200)
    strategy = cls(space, seed=2) if cls is RandomSearch else cls(space, model, seed=2)
    rec = Recorder(strategy)
    lats = replay(rec, table, batch=8, budget=120)
    keys = _keys(rec.proposed)
    assert len(lats) == 120 and len(set(keys)) == 120 and set(keys) <= set(table)


def test_evolutionary_first_batch_is_the_models_top_and_mutation_moves_one_knob(model):
    wl = workload("softmax", M=64, N=32000, dtype="bf16")
    space = ScheduleSpace(wl, MI300X)
    valid = list(space)
    top = [valid[i] for i in np.argsort(-model.score(wl, valid, MI300X), kind="stable")[:8]]
    evo = Evolutionary(space, model, seed=0)
    assert evo.propose(8) == top
    for s in valid:
        child = evo.mutate(s)
        if child is not None:
            assert space.is_valid(child) and sum(child[k] != s[k] for k in s) == 1


def test_evolutionary_finds_the_best_in_fewer_measurements_than_random(model):
    """With a model trained on other workloads, within 3% of the exhaustive best (median of 5 seeds)."""
    evo, evo_refit, rand = [], [], []
    for wl in HELD_OUT:
        for t in TARGETS:
            space, table = ScheduleSpace(wl, t), synthetic_table(wl, t)
            best = best_of(table)

            def median_to_best(make):
                return float(np.median([measurements_to_within(
                    replay(make(seed), table, batch=8, until=best * 1.03), best) for seed in range(5)]))

            evo.append(median_to_best(lambda seed: Evolutionary(space, model, seed)))
            evo_refit.append(median_to_best(lambda seed: Evolutionary(space, model, seed, refit=True)))
            rand.append(median_to_best(lambda seed: RandomSearch(space, seed)))
    print(f"\nmeasurements to within 3% (mean of per-workload medians): evolutionary {np.mean(evo):.1f}, "
          f"with online refit {np.mean(evo_refit):.1f}, random {np.mean(rand):.1f}")
    assert len(evo) == len(HELD_OUT) * len(TARGETS) >= 10
    assert np.mean(evo) <= 0.5 * np.mean(rand) and np.median(evo) < np.median(rand)
    assert np.mean(evo_refit) <= 0.5 * np.mean(rand)
    assert sum(e <= r for e, r in zip(evo, rand)) >= 0.75 * len(evo)


def test_cost_model_facade_drives_the_search(tmp_path):
    """A prior-backed CostModel with refit switches to XGBoost once the search has measured enough."""
    wl = workload("add_rmsnorm", M=2048, N=4096, dtype="bf16")
    space, table = ScheduleSpace(wl, H200), synthetic_table(wl, H200)
    cm = CostModel.for_database(tmp_path / "none.db", "rowwise")
    assert cm.kind == "prior"
    evo = Evolutionary(space, cm, seed=0, refit=True)
    replay(evo, table, batch=8, budget=48)
    assert evo.model.kind == "xgb" and cm.kind == "prior"      # the search's copy learned, not the original


def test_replay_budget_strictness_and_helpers():
    wl = workload("rmsnorm", M=64, N=2048)
    space, table = ScheduleSpace(wl, H200), synthetic_table(wl, H200)
    assert len(replay(RandomSearch(space, 0), table, batch=8, budget=13)) == 13
    best = best_of(table)
    lats = replay(RandomSearch(space, 1), table, batch=4, until=best)   # stops after the batch with the best
    assert best in lats[-4:] and len(lats) % 4 == 0 and best not in lats[:-4]
    with pytest.raises(KeyError, match="not in the replay table"):
        replay(RandomSearch(space, 0), dict(list(table.items())[:3]), batch=8)
    lats = replay(RandomSearch(space, 0), dict(list(table.items())[:3]), batch=8, strict=False)
    assert len(lats) == len(table) and sum(lat is not None for lat in lats) == 3

    assert measurements_to_within([5.0, None, 1.02, 1.0], best=1.0) == 3
    assert measurements_to_within([5.0, 1.04], best=1.0) == 3            # never within 3%: len + 1
    assert measurements_to_within([], best=1.0) == 1
    assert measurements_to_within([1.04], best=1.0, tol=0.05) == 1

    s1, s2 = {"block_r": 1, "block_c": 2048, "num_warps": 4}, {"block_r": 2, "block_c": 2048, "num_warps": 8}
    rec = lambda s, status, lat=None: Record(workload_key=wl.key, workload=wl.to_json(),  # noqa: E731
                                             target_key=H200.id, schedule=s, status=status, latency_us=lat,
                                             device="h200")
    t = table_from_records([rec(s1, "ok", 3.0), rec(s1, "ok", 5.0), rec(s1, "timeout"), rec(s2, "crash")])
    assert t == {schedule_key(s1): 4.0, schedule_key(s2): None}
    assert best_of(t) == 4.0
    # resumed from the database's records, a strategy never re-measures them
    strategy = make_strategy("exhaustive", space, measured=[(s1, 4.0), (s2, None)])
    proposed = replay(strategy, table)
    assert len(proposed) == len(table) - 2


def test_records_older_than_a_knob_are_not_measured_again():
    """A GEMM record written before split_k and persistent existed is the schedule with split_k=1 and
    persistent=0: the search never proposes that again."""
    from flashgen.targets import get_target
    space = ScheduleSpace(workload("gemm", M=64, N=256, K=128), get_target("h200"))
    old = {"block_m": 64, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "group_m": 1}
    strategy = make_strategy("exhaustive", space, None, seed=0, measured=[(old, 5.0)])
    assert strategy.seen(space.complete(old)) and strategy.seen(old)
    proposed = []
    while batch := strategy.propose(64):
        proposed += batch
    assert space.complete(old) not in proposed and len(proposed) == len(list(space)) - 1


def test_make_strategy_names():
    space = ScheduleSpace(workload("rmsnorm", M=4, N=1024), H200)
    assert isinstance(make_strategy("exhaustive", space), Exhaustive)
    assert isinstance(make_strategy("random", space, seed=3), RandomSearch)
    evo = make_strategy("evolutionary", space, None, 0, population=4, epsilon=0.2)
    assert isinstance(evo, Evolutionary) and evo.population == 4 and evo.epsilon == 0.2
    with pytest.raises(FlashgenError, match="unknown search strategy"):
        make_strategy("beam", space)
    with pytest.raises(FlashgenError, match="epsilon"):
        Evolutionary(space, epsilon=1.5)


def _replay_db(tmp_path, name):
    from flashgen.db import Database
    return Database(tmp_path / f"{name}.db")


def test_replayed_tune_counts_the_default_first_and_the_tuners_batches(tmp_path):
    """The tuner's loop, replayed: the analytic default is measured first, then full batches of
    tuner.BATCH; a tune pays to the end of the batch that found the best."""
    from flashgen.schedules.replay import replay_tune
    from flashgen.schedules.tuner import BATCH
    wl = workload("rmsnorm", M=32, N=4096, dtype="bf16")
    space = ScheduleSpace(wl, H200)
    valid = list(space)
    default = space.pinned_default()
    # exhaustive tunes in the prior's order; the tuner puts the default first
    prior = AnalyticPrior().score(wl, valid, H200)
    order = [default] + [valid[i] for i in np.argsort(-prior, kind="stable") if valid[i] != default]
    assert len(order) >= 3 * BATCH

    table = {schedule_key(s): 10.0 for s in valid}
    table[schedule_key(default)] = 1.0  # the default is the best: one measurement, one batch paid
    for strategy in ("random", "evolutionary", "exhaustive"):
        run = replay_tune(space, _replay_db(tmp_path, f"a-{strategy}"), table, strategy, seed=3, until=1.03)
        assert run.latencies[0] == 1.0 and run.batches == [BATCH]
        assert measurements_to_within(run.latencies, 1.0) == 1 and run.paid_to_within(1.0) == BATCH

    best = order[BATCH + 4]  # the fifth schedule of the second batch
    table = {**{k: 10.0 for k in table}, schedule_key(best): 1.0}
    run = replay_tune(space, _replay_db(tmp_path, "b"), table, "exhaustive", until=1.03)
    assert run.batches == [BATCH, BATCH]
    assert measurements_to_within(run.latencies, 1.0) == BATCH + 5 and run.paid_to_within(1.0) == 2 * BATCH
    # never within reach: every schedule measured once, counted as the space + 1
    run = replay_tune(space, _replay_db(tmp_path, "c"), {k: 10.0 for k in table}, "random", until=1.03)
    assert len(run.latencies) == len(valid) and run.paid_to_within(1.0) == len(valid) + 1


def test_a_tune_fills_its_first_batch_when_the_strategy_proposes_the_default(tmp_path):
    """The strategy does not know the default is pending: where it proposes it too, the batch is topped
    up rather than measured one short."""
    from flashgen.schedules.replay import replay_tune
    from flashgen.schedules.tuner import BATCH
    wl = workload("rmsnorm", M=32, N=4096, dtype="bf16")
    space = ScheduleSpace(wl, H200)
    valid = list(space)
    prior = AnalyticPrior().score(wl, valid, H200)
    top = [schedule_key(valid[i]) for i in np.argsort(-prior, kind="stable")[:BATCH]]
    assert schedule_key(space.pinned_default()) in top  # the prior's first batch holds the default
    run = replay_tune(space, _replay_db(tmp_path, "x"), {schedule_key(s): 5.0 for s in valid}, "exhaustive")
    assert run.batches[0] == BATCH and len(run.latencies) == len(valid)


def test_recorded_space_holds_the_records_and_the_default_only():
    """A GEMM space cut down to its records: validity, iteration, size and samples touch them alone."""
    import random as _random

    from flashgen.schedules.replay import RecordedSpace
    from flashgen.targets import get_target
    full = ScheduleSpace(workload("gemm", M=16, N=4096, K=4096, dtype="bf16"), get_target("h200"))
    rng = _random.Random(0)
    picked = []
    while len(picked) < 12:
        s = full.sample(rng)
        if full.is_valid(s) and s not in picked:
            picked.append(s)
    space = RecordedSpace.of(full, picked + [{"block_m": 3}])  # an invalid record is left out
    keys = {schedule_key(s) for s in picked} | {schedule_key(full.pinned_default())}
    assert {schedule_key(s) for s in space} == keys and space.raw_size() == len(keys)
    assert space.is_valid(picked[0]) and space.pinned_default() == full.pinned_default()
    other = next(s for s in (full.sample(rng) for _ in range(1000)) if full.is_valid(s) and schedule_key(s) not in keys)
    assert space.why_invalid(other) == "not one of the recorded schedules"
    assert all(schedule_key(space.sample(rng)) in keys for _ in range(20))


def test_a_fresh_search_of_a_256_row_w4a8_gemm_proposes_tiles_that_read_the_weight_at_most_twice():
    """With no trained model (a database too small), the evolutionary search ranks by the analytic
    estimate. After the two schedules a tune measures first on the H100 (the default, 21.1 us, and a
    128 x 64 tile, 20.4 us), it once proposed only 32-row tiles, which unpack the weight 8 times and took
    29.7-103.5 us (benchmarks/results/h100_rows_records.jsonl); now tiles of 128 rows or more."""
    import flashgen
    from flashgen.schedules.contraction_space import flat_of
    from flashgen.targets import get_target
    wl = flashgen.workload("gemm_w4a8", M=256, N=6144, K=4096, G=128, dtype="bf16", pack="lanes")
    space = ScheduleSpace(wl, get_target("h100"))
    served = {"variant": "tile_lanes_scaled", "block_m": 128, "block_n": 64, "block_k": 128, "num_warps": 4,
              "num_stages": 5, "group_m": 1, "split_k": 1, "persistent": 2}
    for seed in (0, 1):
        search = make_strategy("evolutionary", space, None, seed, measured=[(space.default(), 21.05), (served, 20.37)])
        rows = [flat_of(wl, space.complete(s))["block_m"] for s in search.propose(14)]
        assert sum(r >= 128 for r in rows) >= 12, rows
