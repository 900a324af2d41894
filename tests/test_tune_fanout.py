"""`flashgen tune --gpus` and `--ray`: the plan's grouping (a producer's consumers after it, in its
group), the GPUs each worker sees, and real fan-outs of cpu-target tunes, over two worker processes and
over two actors of a local Ray cluster, that record every workload's measurements once, into one
database. Without a GPU, or on the cpu target, --gpus and --ray are one line."""
from __future__ import annotations

import functools
import os
import socket

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


def test_the_runner_of_every_line_gets_the_options_timeouts(tmp_path, monkeypatch):
    """A fan-out's workers (processes or Ray actors) build their Runner from each line's task: bounds
    given in TuneOptions reach it, so a loaded machine's tunes can wait longer for a fresh worker."""
    import flashgen.schedules.tuner as tuner

    seen = []

    class Stop(Exception):
        pass

    def runner(target, **kw):
        seen.append((kw["timeout_s"], kw["start_timeout_s"]))
        raise Stop

    monkeypatch.setattr(tuner, "Runner", runner)
    task = TuneOptions(2, timeout_s=7.0, start_timeout_s=900.0).task(_wl("softmax", 8), get_target("cpu"))
    with Database(tmp_path / "t.db") as db, pytest.raises(Stop):
        tuner.tune(task, db)
    assert seen == [(7.0, 900.0)]


def test_each_worker_sees_one_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_slots("all", 4) == ["0", "1", "2", "3"]
    assert gpu_slots("2", 4) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert gpu_slots("all", 2) == ["5", "7"]
    for spec, gpus, message in (("3", 2, "--gpus 3: this machine has 2 GPUs"),
                                ("all", 0, "--gpus: this machine has no GPU"),
                                ("0", 2, "--gpus takes 'all' or a number of GPUs of at least 1, got '0'"),
                                ("foo", 0, "--gpus takes 'all' or a number of GPUs of at least 1, got 'foo'")):
        with pytest.raises(FlashgenError, match=message):
            gpu_slots(spec, gpus)


PLAN = [(_wl(op, m), None) for op, m in (("softmax", 8), ("rmsnorm", 16), ("silu_mul", 8), ("softmax", 4))]


def collect(outcomes: dict):
    def on_result(i, outcome):
        assert i not in outcomes  # each workload once
        outcomes[i] = outcome
    return on_result


def check_tuned_once(db_path, outcomes: dict, trials: int, earlier: dict[int, int] | None = None) -> None:
    """Every line tuned, `trials` new measurements each (besides `earlier` ones by line), every record in
    the one database, no schedule measured twice."""
    earlier = earlier or {}
    assert sorted(outcomes) == list(range(len(PLAN)))
    with Database(db_path) as db:
        for i, (wl, _) in enumerate(PLAN):
            assert outcomes[i].measured == trials and outcomes[i].best is not None
            records = db.records(wl.key, "cpu/host")
            assert len(records) == trials + earlier.get(i, 0) == len({r.schedule_key for r in records})
            assert all(r.status == "ok" for r in records)


class DiesInWorker:
    """A producer whose key ends any process but the test's: the worker that tunes its line dies."""

    def __init__(self):
        self.home = os.getpid()

    @property
    def key(self) -> str:
        if os.getpid() != self.home:
            os._exit(7)
        return "dies"


def test_two_workers_tune_every_workload_once(tmp_path):
    """Four workloads over two worker processes (cpu target), and a fifth line that kills the worker
    tuning it: reported as not tuned, the other worker tunes the rest."""
    outcomes: dict = {}
    plan = PLAN + [(_wl("softmax", 2), DiesInWorker())]
    fan_out(plan, get_target("cpu"), str(tmp_path / "t.db"), TuneOptions(3, strategy="random"), [None, None],
            collect(outcomes))
    assert outcomes.pop(len(PLAN)) == "its worker (a CPU worker) died with exit code 7"
    check_tuned_once(tmp_path / "t.db", outcomes, 3)


def test_a_local_ray_cluster_tunes_every_workload_once(tmp_path, monkeypatch):
    """The same over two actors of a Ray cluster on this machine (loopback only), the database seeded
    with two measurements of one workload, which its actor does not make again."""
    ray = pytest.importorskip("ray")
    from flashgen.schedules.ray_fanout import fan_out_ray
    from flashgen.schedules.tuner import TuneTask, tune

    target, db_path = get_target("cpu"), tmp_path / "t.db"
    with Database(db_path) as db:
        tune(TuneTask(PLAN[1][0], target, 2, strategy="random", seed=5), db)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        outcomes: dict = {}
        # (bounds fit for a loaded CI machine: each actor starts a measuring worker and a builder pool)
        fan_out_ray(PLAN, target, str(db_path), TuneOptions(3, strategy="random", timeout_s=600, start_timeout_s=1200),
                    None, collect(outcomes), cpu_workers=2)
    finally:
        ray.shutdown()
    check_tuned_once(db_path, outcomes, 3, earlier={1: 2})


def test_gpus_or_ray_without_a_gpu_or_on_the_cpu_target_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    f = tmp_path / "w.jsonl"
    f.write_text('{"op": "softmax", "dims": {"M": 8, "N": 512}}\n')
    for target, flags, message in (
            ("h200", ["--gpus", "all"], "--gpus: this machine has no GPU"),
            ("cpu", ["--gpus", "all"], "--gpus spreads a GPU target's tuning over GPUs; cpu/host measures on this CPU"),
            ("cpu", ["--ray", "auto"], "--ray spreads a GPU target's tuning over GPUs; cpu/host measures on this CPU"),
            ("h200", ["--ray", "auto", "--gpus", "2"], "give --gpus (this machine's GPUs) or --ray (a cluster's), not both")):
        assert main(["tune", "--workloads", str(f), "--target", target, *flags, "--db", str(tmp_path / "t.db")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_a_ray_address_with_no_cluster_is_one_line(tmp_path, capsys, monkeypatch):
    """A HOST:PORT nothing listens on is refused at once (Ray would retry it for minutes); 'auto' with no
    cluster running is refused too. (Ray's 'auto' joins any local cluster it finds, such as the one a
    test on another worker runs at the same time: its lookup is made to find none.)"""
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray._private.services, "find_gcs_addresses", functools.lru_cache(lambda: []))
    monkeypatch.setattr(ray._private.services, "find_bootstrap_address", lambda temp_dir: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]  # (closed: nothing listens there)
    for address, message in ((f"127.0.0.1:{free}", "no Ray cluster answers there"),
                             ("auto", "cannot join a Ray cluster")):
        assert main(["tune", "softmax", "--dim", "M=8", "--dim", "N=512", "--target", "h200", "--ray", address,
                     "--db", str(tmp_path / "t.db")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--ray {address}: {message}" in err, err
