"""`flashgen tune --gpus`: the plan's grouping (a producer's consumers after it, in its group), the
GPUs each worker sees, and a real fan-out of cpu-target tunes over two worker processes that records
every workload's measurements once, into one database. Without a GPU, --gpus is one line."""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.cli import main
from flashgen.db import Database
from flashgen.errors import FlashgenError
from flashgen.schedules.fanout import TuneOptions, fan_out, gpu_slots, groups
from flashgen.targets import get_target


def _wl(op: str, m: int, n: int = 512):
    return flashgen.workload(op, M=m, N=n, dtype="fp32")


def test_a_consumer_joins_its_producers_group_after_it():
    a, b, c, d = _wl("rmsnorm", 8), _wl("softmax", 8), _wl("silu_mul", 8, 256), _wl("softmax", 16)
    plan = [(a, None), (b, None), (c, a), (d, c), (a, b), (_wl("rmsnorm", 4), d)]
    assert groups(plan) == [[0, 2, 3, 5], [1, 4]]  # (line 4 tunes a again, behind b: in b's group)
    assert sorted(i for g in groups(plan) for i in g) == list(range(len(plan)))


def test_each_worker_sees_one_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_slots("all", 4) == ["0", "1", "2", "3"]
    assert gpu_slots("2", 4) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert gpu_slots("all", 2) == ["5", "7"]
    for spec, gpus, message in (("3", 2, "--gpus 3: this machine has 2 GPUs"),
                                ("all", 0, "--gpus: this machine has no GPU"),
                                ("0", 2, "--gpus takes 'all' or a number of GPUs of at least 1, got '0'")):
        with pytest.raises(FlashgenError, match=message):
            gpu_slots(spec, gpus)


def test_two_workers_tune_every_workload_once(tmp_path):
    """Four workloads over two worker processes (cpu target): each tuned once, its trials all recorded
    in the one database, no schedule measured twice."""
    plan = [(_wl(op, m), None) for op, m in (("softmax", 8), ("rmsnorm", 16), ("silu_mul", 8), ("softmax", 4))]
    target, db_path, trials = get_target("cpu"), tmp_path / "t.db", 3
    outcomes: dict[int, object] = {}

    def on_result(i, outcome):
        assert i not in outcomes
        outcomes[i] = outcome

    fan_out(plan, target, str(db_path), TuneOptions(trials, strategy="random"), [None, None], on_result)
    assert sorted(outcomes) == list(range(len(plan)))
    with Database(db_path) as db:
        for i, (wl, _) in enumerate(plan):
            assert outcomes[i].measured == trials and outcomes[i].best is not None
            records = db.records(wl.key, target.id)
            assert len(records) == trials == len({r.schedule_key for r in records})
            assert all(r.status == "ok" for r in records)


def test_gpus_without_a_gpu_or_on_the_cpu_target_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    f = tmp_path / "w.jsonl"
    f.write_text('{"op": "softmax", "dims": {"M": 8, "N": 512}}\n')
    for target, message in (("h200", "--gpus: this machine has no GPU"),
                            ("cpu", "--gpus spreads a GPU target's tuning over GPUs; cpu/host measures on this CPU")):
        assert main(["tune", "--workloads", str(f), "--target", target, "--gpus", "all",
                     "--db", str(tmp_path / "t.db")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
