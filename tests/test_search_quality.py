"""benchmarks/search_quality.py and benchmarks/transfer.py on small synthetic record sets (CPU replays)."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from flashgen.db import Record
from flashgen.schedules.space import ScheduleSpace
from flashgen.schedules.tuner import BATCH
from flashgen.targets import get_target
from flashgen.workload import workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
H100, H200 = get_target("h100"), get_target("h200")


def _line(wl, schedule, latency, target=H200, **extra) -> str:
    return json.dumps(Record(workload_key=wl.key, workload=wl.to_json(), target_key=target.id, schedule=schedule,
                             status="ok", latency_us=latency, spread_us=0.1, device=target.device,
                             extra=extra).to_json()) + "\n"


def _run(monkeypatch, tmp_path, lines, *args):
    import search_quality
    log = tmp_path / "records.jsonl"
    log.write_text("".join(lines))
    monkeypatch.setattr(sys, "argv", ["search_quality.py", str(log), "--out-dir", str(tmp_path), "--name", "sq", *args])
    search_quality.main()
    return json.loads((tmp_path / "sq.json").read_text())


def test_counts_as_a_user_pays_beside_the_plain_count(monkeypatch, tmp_path):
    """Two exhaustive sweeps whose analytic default is the one fast schedule: the tuner measures it
    first (1 measurement) and pays its whole first batch; the plain count never measures it first."""
    lines = []
    for n in (4096, 8192):
        wl = workload("rmsnorm", M=1, N=n, dtype="bf16")
        space = ScheduleSpace(wl, H200)
        default = space.pinned_default()
        lines += [_line(wl, s, 1.0 if s == default else 2.0) for s in space]
        assert sum(1 for _ in space) > BATCH
    out = _run(monkeypatch, tmp_path, lines)
    cols = out["search"]["columns"]
    rows = [dict(zip(cols, r)) for r in out["search"]["rows"] if r[0].startswith("rmsnorm")]
    assert len(rows) == 2
    for r in rows:
        assert r["evolutionary_tuner"] == r["random_tuner"] == 1
        assert r["evolutionary_paid"] == r["random_paid"] == BATCH
        assert r["random_plain"] > 1  # random search alone must find the default among the rest
    assert set(out["protocols"]) == {"plain", "tuner", "paid"} and "exhaustive best" in out["ground_truth"]
    md = (tmp_path / "sq.md").read_text()
    assert all(f"`{p}`" in md for p in out["protocols"])


def test_a_contraction_replay_visits_only_the_recorded_schedules(monkeypatch, tmp_path):
    """--recorded replays GEMMs within their records: no space of the whole product of knobs is ever
    walked (each GEMM space holds ~10^4-10^5 points before its rules)."""
    from flashgen.schedules import space as space_mod
    walked = []
    whole_iter = space_mod.ScheduleSpace.__iter__

    def counting_iter(self):
        for s in whole_iter(self):
            walked.append(type(self).__name__)
            if len(walked) > 10_000:
                raise AssertionError("walked the whole space")
            yield s

    lines, rng = [], random.Random(1)
    for n in (4096, 6144):
        wl = workload("gemm", M=16, N=n, K=4096, dtype="bf16")
        space = ScheduleSpace(wl, H200)
        assert space.raw_size() > 10_000
        picked = []
        while len(picked) < 20:
            s = space.sample(rng)
            if space.is_valid(s) and s not in picked:
                picked.append(s)
        lines += [_line(wl, s, rng.uniform(5.0, 50.0)) for s in picked]
    monkeypatch.setattr(space_mod.ScheduleSpace, "__iter__", counting_iter)
    out = _run(monkeypatch, tmp_path, lines, "--recorded", "--min-recorded", "10")
    assert walked == []  # (RecordedSpace iterates its records without the whole space's iterator)
    rows = [r for r in out["search"]["rows"] if r[0].startswith("gemm")]
    assert len(rows) == 2 and all(20 <= r[1] <= 21 for r in rows)  # the records, and the default if unrecorded
    assert "best recorded" in out["ground_truth"]


def test_transfer_scores_known_by_hand():
    import transfer
    lats = [1.0, 2.0, 4.0]
    assert transfer.topk([3, 2, 1], lats, 1) == 1.0 and transfer.topk([1, 2, 3], lats, 1) == 0.25
    assert transfer.topk([1, 2, 3], lats, 2) == 0.5
    assert transfer.random_topk(lats, 1) == pytest.approx((1 + 1 / 2 + 1 / 4) / 3)
    assert transfer.random_topk(lats, 2) == pytest.approx((1 + 1 + 1 / 2) / 3)  # pairs {1,2} {1,4} {2,4}
    assert transfer.random_topk(lats, 5) == 1.0
    assert transfer.spearman([3, 2, 1], [-x for x in lats]) == pytest.approx(1.0)
    assert transfer.spearman([1, 2, 3], [-x for x in lats]) == pytest.approx(-1.0)
    assert transfer.spearman([1, 1, 2, 3], [4, 3, 2, 1]) == pytest.approx(-0.9486832980505138)  # tied ranks 0.5, 0.5


def test_device_features_differ_between_h100_and_h200():
    """The descriptors give the two the same SMs, clocks and peak rates, and other bandwidths: every
    class's features carry the bandwidth, so a model can tell the devices apart."""
    import numpy as np

    from flashgen.schedules.features import feature_matrix, feature_names
    assert H100.sm_count == H200.sm_count and H100.peak_tflops == H200.peak_tflops
    assert H100.copy_gbs != H200.copy_gbs
    for wl in (workload("gemm", M=16, N=4096, K=4096, dtype="bf16"), workload("rmsnorm", M=16, N=4096, dtype="bf16"),
               workload("silu_mul", M=16, N=4096, dtype="bf16")):
        space = ScheduleSpace(wl, H200)
        s = [space.default()]
        names = feature_names(wl.op.kclass)
        a, b = feature_matrix(wl, s, H100)[0], feature_matrix(wl, s, H200)[0]
        differ = {n for n, x, y in zip(names, a, b) if x != y}
        assert "log2_copy_gbs" in differ and "sm_count" not in differ, (wl.op.kclass, differ)
        assert a[names.index("log2_copy_gbs")] == pytest.approx(np.log2(H100.copy_gbs))


def _gemm_samples(rng):
    """One GEMM's schedules on both devices, ranked in opposite orders on the two."""
    wl = workload("gemm", M=16, N=4096, K=4096, dtype="bf16")
    space = ScheduleSpace(wl, H200)
    picked = []
    while len(picked) < 24:
        s = space.sample(rng)
        if space.is_valid(s) and s not in picked:
            picked.append(s)
    return wl, picked


def test_a_model_trained_on_mixed_devices_ranks_each_devices_own_order():
    from flashgen.schedules.cost_model import XGBCostModel
    import transfer
    wl, picked = _gemm_samples(random.Random(2))
    samples = [(wl, s, t, 10.0 + (i if t is H200 else len(picked) - i)) for t in (H100, H200) for i, s in enumerate(picked)]
    model = XGBCostModel("rank", num_rounds=60).fit(samples)
    for t in (H100, H200):
        lats = [lat for w, s, tt, lat in samples if tt is t]
        assert transfer.spearman(model.score(wl, picked, t), [-x for x in lats]) > 0.9


def test_transfer_ranks_another_devices_records(monkeypatch, tmp_path):
    """benchmarks/transfer.py trains on the H200's records only and scores the H100's groups (timed behind a
    producer) for the model, the prior and a random order."""
    import transfer
    rng = random.Random(4)
    wl, picked = _gemm_samples(rng)
    other = workload("gemm", M=16, N=6144, K=4096, dtype="bf16")
    train = [_line(wl, s, 10.0 + i) for i, s in enumerate(picked)] + [_line(other, s, 20.0 + i) for i, s in enumerate(picked)]
    behind = workload("rmsnorm", M=16, N=4096, dtype="bf16").to_json()
    test = [_line(wl, s, 5.0 + i, H100, timing="behind", behind=behind, behind_schedule={}) for i, s in enumerate(picked[:10])]
    (tmp_path / "train.jsonl").write_text("".join(train))
    (tmp_path / "test.jsonl").write_text("".join(test + [_line(wl, picked[0], 1.0, H100)]))  # a lone group: not scored
    transfer.main(["--train", str(tmp_path / "train.jsonl"), "--test", str(tmp_path / "test.jsonl"),
                   "--out-dir", str(tmp_path), "--name", "tr"])
    out = json.loads((tmp_path / "tr.json").read_text())
    rows = {r[0]: r[1:] for r in out["rows"]}
    assert set(rows) == {"rank model (cuda:sm_90/h200)", "rank model, the test's workloads held out", "analytic prior",
                         "random order"}
    assert rows["random order"][:2] == pytest.approx([transfer.random_topk([5.0 + i for i in range(10)], k) for k in (1, 5)])
    assert rows["rank model (cuda:sm_90/h200)"][2] > 0.9  # the H200's order of this GEMM is the H100's here
    assert "1 groups" in (tmp_path / "tr.md").read_text()
