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
