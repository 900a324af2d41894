"""End-to-end tuning on the cpu target with real measurements, through the CLI and the API."""
from __future__ import annotations

import json

import pytest

import flashgen
from flashgen.cli import main
from flashgen.db import Database
from flashgen.schedules.space import ScheduleSpace
from flashgen.schedules.tuner import TuneTask, tune
from flashgen.targets import get_target


def test_tune_cli_records_best_and_compile_uses_it(tmp_path, capsys):
    db_path, plot = tmp_path / "t.db", tmp_path / "best.png"
    code = main(["tune", "rmsnorm", "--dim", "M=64", "--dim", "N=2048", "--dtype", "fp32", "--target", "cpu",
                 "--trials", "6", "--db", str(db_path), "--plot", str(plot)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "6/6" in err and "of roofline" in err          # the progress line
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    wl = flashgen.workload("rmsnorm", M=64, N=2048, dtype="fp32")
    target = get_target("cpu")
    with Database(db_path) as db:
        records = db.records(wl.key, target.id)
        best = db.best(wl.key, target.id)
    assert len(records) == 6 and all(r.status == "ok" for r in records)
    default = ScheduleSpace(wl, target).default()
    by_key = {r.schedule_key: r for r in records}
    from flashgen.db.record import schedule_key
    assert best.latency_us <= by_key[schedule_key(default)].latency_us   # never worse than untuned
    code = main(["compile", "rmsnorm", "--dim", "M=64", "--dim", "N=2048", "--dtype", "fp32", "--target", "cpu",
                 "--db", str(db_path), "--out", str(tmp_path / "k")])
    out, err = capsys.readouterr()
    assert code == 0, err and "database best" in out
    meta = json.loads((tmp_path / "k" / "rmsnorm_kernel.json").read_text())
    assert meta["schedule"] == best.schedule


def test_tune_resumes_without_measuring_again(tmp_path):
    wl = flashgen.workload("silu_mul", M=16, N=1000, dtype="fp32")
    target = get_target("cpu")
    with Database(tmp_path / "t.db") as db:
        first = tune(TuneTask(wl, target, 4, strategy="random", seed=1), db, progress=None)
        second = tune(TuneTask(wl, target, 4, strategy="evolutionary", seed=2), db, progress=None)
        records = db.records(wl.key, target.id)
    assert first.measured == 4 and second.measured == 4
    assert len({r.schedule_key for r in records}) == len(records) == 8
    assert second.best.latency_us <= first.best.latency_us


def test_tune_takes_a_count_of_trials_past_sys_maxsize(tmp_path):
    """The API takes any count (the CLI bounds --trials): the space runs out, islice does not raise."""
    wl = flashgen.workload("rmsnorm", M=3, N=64, dtype="fp32")
    target = get_target("cpu")
    with Database(tmp_path / "t.db") as db:  # every knob pinned: a space of one schedule
        every = TuneTask.pinned(ScheduleSpace(wl, target).default())
        res = tune(TuneTask(wl, target, 10**20, strategy="exhaustive", fixed=every), db, progress=None)
    assert res.measured == 1


def test_tune_workloads_file(tmp_path, capsys):
    f = tmp_path / "w.jsonl"
    f.write_text("\n".join(json.dumps(flashgen.workload(op, M=8, N=512, dtype="fp32").to_json())
                           for op in ("softmax", "dynamic_quant")) + "\n")
    code = main(["tune", "--workloads", str(f), "--target", "cpu", "--trials", "3", "--db", str(tmp_path / "t.db")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.count("best ") == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"op": "softmax", "dims": {"M": 8}}\n')
    assert main(["tune", "--workloads", str(bad), "--target", "cpu", "--db", str(tmp_path / "t.db")]) == 2
    assert "bad.jsonl:1:" in capsys.readouterr().err


def test_tune_gpu_target_without_gpu_is_a_clear_error(tmp_path, capsys):
    code = main(["tune", "rmsnorm", "--dim", "M=8", "--dim", "N=512", "--target", "h200", "--trials", "2",
                 "--db", str(tmp_path / "t.db")])
    assert code == 2 and "needs that GPU" in capsys.readouterr().err


def test_tune_fix_pins_a_knob_and_counts_only_its_subspace(tmp_path, capsys):
    wl = flashgen.workload("silu_mul", M=16, N=1000, dtype="fp32")
    target = get_target("cpu")
    with Database(tmp_path / "t.db") as db:
        tune(TuneTask(wl, target, 3, strategy="random", seed=1), db, progress=None)          # records outside the pin too
        pinned = tune(TuneTask(wl, target, 3, strategy="evolutionary", seed=2, fixed=TuneTask.pinned({"block_c": 32})), db, progress=None)
        records = db.records(wl.key, target.id)
    assert pinned.measured == 3
    assert sum(r.schedule["block_c"] == 32 for r in records) >= 3
    space = ScheduleSpace(wl, target, (("block_c", 32),))
    assert space.knobs()["block_c"] == (32,) and all(s["block_c"] == 32 for s in space)
    assert space.pinned_default() == {**space.default(), "block_c": 32}
    from flashgen.db.record import schedule_key
    [first] = [r for r in records if r.schedule_key == schedule_key(space.pinned_default())]
    assert pinned.default_us == first.latency_us        # the pinned default is measured first
    for bad, msg in ((["--fix", "stages=2"], "no such knob"), (["--fix", "block_c=33"], "not one of"),
                     (["--fix", "block_c=x"], "integers")):
        code = main(["tune", "silu_mul", "--dim", "M=16", "--dim", "N=1000", "--dtype", "fp32", "--target", "cpu",
                     "--trials", "1", "--db", str(tmp_path / "t.db"), *bad])
        assert code == 2 and msg in capsys.readouterr().err


def test_tune_seeds_a_weight_dequantized_first_with_dense_records(tmp_path):
    """A tune of a quantized GEMM that may dequantize first tries the fastest records of its dense
    form (here recorded in the other 16-bit dtype) as its first candidates, in their dequantized-first variant."""
    from flashgen.db import Record
    from flashgen.schedules.tuner import dense_seeds
    h200 = get_target("h200")
    dense = flashgen.workload("gemm", M=4096, N=512, K=1024, dtype="bf16")
    fast = {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 4, "group_m": 8, "tma": 1}
    slow = {**fast, "num_stages": 3, "persistent": 2}
    with Database(tmp_path / "db.sqlite") as db:
        db.add_many([Record(workload_key=dense.key, workload=dense.to_json(), target_key=h200.id, schedule=s,
                            status="ok", latency_us=us, spread_us=0.1, device="NVIDIA H200") for s, us in ((slow, 90.0), (fast, 80.0))])
        wl = flashgen.workload("gemm_w4a16", M=4096, N=512, K=1024, G=128, dtype="fp16")
        seeds = dense_seeds(ScheduleSpace(wl, h200), db)
        assert [(s["num_stages"], s["variant"]) for s in seeds] == [(4, "dq_tile_tma"), (3, "dq_tile_tma")]
        assert dense_seeds(ScheduleSpace(wl.with_dims(M=256), h200), db) == []
        assert dense_seeds(ScheduleSpace(wl, h200, (("dequant_first", 0),)), db) == []


BEHIND = {"op": "rmsnorm", "dims": {"M": 64, "N": 2048}, "attrs": {"dtype": "fp32"}}


def test_tune_behind_a_producer_keeps_its_own_records(tmp_path, capsys):
    """A tune behind a producer re-times schedules measured alone, the fastest of them first after the
    default, records how each was timed, and becomes what dispatch serves; the cost model and the
    replay tables leave its records out."""
    from flashgen.runtime.serving.dispatch import Dispatcher
    from flashgen.schedules.cost_model import samples_from_records
    from flashgen.schedules.replay import table_from_records
    from flashgen.schedules.tuner import ALONE_SEEDS

    wl = flashgen.workload("softmax", M=64, N=2048, dtype="fp32")
    target = get_target("cpu")
    db_path = tmp_path / "t.db"
    with Database(db_path) as db:
        alone = tune(TuneTask(wl, target, 8, strategy="random", seed=3), db, progress=None)
    assert alone.measured == 8
    code = main(["tune", "softmax", "--dim", "M=64", "--dim", "N=2048", "--dtype", "fp32", "--target", "cpu",
                 "--trials", "5", "--db", str(db_path), "--behind", json.dumps(BEHIND)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "behind rmsnorm M=64 N=2048" in out
    with Database(db_path) as db:
        records = db.records(wl.key, target.id)
        best = db.best(wl.key, target.id)
    first, second = records[:8], records[8:]
    assert len(second) == 5 and all(r.status == "ok" and r.timing == "behind" for r in second)
    assert all(r.extra["behind"] == BEHIND and r.extra["behind_schedule"] for r in second)
    space = ScheduleSpace(wl, target)
    ranked = sorted((r for r in first if r.status == "ok"), key=lambda r: r.latency_us)
    expected = [space.default()] + [space.complete(r.schedule) for r in ranked[:ALONE_SEEDS]
                                    if space.complete(r.schedule) != space.default()]
    assert [r.schedule for r in second] == expected[:5]     # measured again, the fastest alone first
    assert best.timing == "behind" and best.latency_us == min(r.latency_us for r in second)
    assert Dispatcher(target, db_path).choose(wl, target).source == "exact (timed behind rmsnorm)"
    assert len(samples_from_records(records)) == 8
    assert len(table_from_records(records)) == len({r.schedule_key for r in first})
    # resumed, it measures none of its own schedules again
    with Database(db_path) as db:
        producer = (flashgen.workload("rmsnorm", M=64, N=2048, dtype="fp32"), best.extra["behind_schedule"])
        again = tune(TuneTask(wl, target, 2, strategy="random", seed=4, behind=producer), db, progress=None)
        keys = [r.schedule_key for r in db.records(wl.key, target.id) if r.timing == "behind"]
    assert again.measured == 2 and len(keys) == len(set(keys)) == 7
    from flashgen.errors import FlashgenError
    from flashgen.schedules.measure import Runner
    with Database(db_path) as db, pytest.raises(FlashgenError, match="runner given times alone"):
        tune(TuneTask(wl, target, 1, behind=(flashgen.workload("rmsnorm", M=64, N=2048, dtype="fp32"), {})), db, runner=Runner(target))


def test_tune_behind_a_producer_that_cannot_feed_it_is_a_clear_error(tmp_path, capsys):
    code = main(["tune", "softmax", "--dim", "M=64", "--dim", "N=1000", "--dtype", "fp32", "--target", "cpu",
                 "--db", str(tmp_path / "t.db"), "--behind", json.dumps(BEHIND)])
    out, err = capsys.readouterr()
    assert code != 0 and "rmsnorm writes y [64, 2048] fp32, but softmax reads x [64, 1000] fp32" in err
    assert err.count("\n") == 1
    code = main(["tune", "softmax", "--dim", "M=64", "--dim", "N=2048", "--dtype", "fp32", "--target", "cpu",
                 "--db", str(tmp_path / "t.db"), "--behind", "{op"])
    assert code != 0 and "--behind: not JSON" in capsys.readouterr().err


def test_alone_seeds_come_from_the_plain_form_where_the_workload_has_none(tmp_path):
    """A GEMM with a residual epilogue and no records of its own is seeded, behind a producer, with its
    plain form's fastest schedules timed alone (what dispatch would serve it), never with records timed
    behind a producer; once it has records timed alone, those."""
    from flashgen.db import Record
    from flashgen.schedules.tuner import alone_seeds
    h200 = get_target("h200")
    wl = flashgen.workload("gemm", M=1, N=4096, K=4096, dtype="bf16", with_residual="yes")
    plain = flashgen.workload("gemm", M=1, N=4096, K=4096, dtype="bf16")
    space = ScheduleSpace(wl, h200)
    base = space.default()

    def rec(w, us, timing=None, **knobs):
        return Record(workload_key=w.key, workload=w.to_json(), target_key=h200.id, schedule={**base, **knobs},
                      status="ok", latency_us=us, device="NVIDIA H200", extra={"timing": timing} if timing else {})
    with Database(tmp_path / "db.sqlite") as db:
        db.add_many([rec(plain, 12.0, num_stages=4), rec(plain, 11.0, num_stages=2),
                     rec(plain, 1.0, "behind", num_stages=5), rec(wl, 1.0, "behind", num_stages=5)])
        assert [s["num_stages"] for s in alone_seeds(space, db)] == [2, 4]
        db.add(rec(wl, 20.0, num_stages=3))
        assert [s["num_stages"] for s in alone_seeds(space, db)] == [3]


def test_a_tune_measures_the_served_schedule_after_the_default(tmp_path, capsys):
    """On the CPU, for real, through the CLI: two trials of a fresh row count measure the default, then
    the schedule dispatch served it before the tune (a neighbouring row count's record), so a tune of
    a few trials cannot leave the call slower."""
    from flashgen.db import Record
    cpu = get_target("cpu")
    w8 = flashgen.workload("silu_mul", M=8, N=1000, dtype="fp32")
    served = {"block_r": 1, "block_c": 32, "num_warps": 1}
    space = ScheduleSpace(w8.with_dims(M=16), cpu)
    assert served != space.default()
    db = str(tmp_path / "db.sqlite")
    with Database(db) as d:
        d.add(Record(workload_key=w8.key, workload=w8.to_json(), target_key=cpu.id, schedule=served,
                     status="ok", latency_us=5.0, device="cpu"))
    argv = ["tune", "silu_mul", "--dim", "M=16", "--dim", "N=1000", "--dtype", "fp32", "--target", "cpu",
            "--trials", "2", "--db"]
    assert main(argv + [db]) == 0
    with Database(db) as d:
        assert [space.complete(r.schedule) for r in d.records(space.workload.key, cpu.id)] == [space.default(), served]


def test_tune_workloads_file_with_a_producer_per_line(tmp_path, capsys):
    """A decode chain in one file: each line may name the producer it is timed behind, tuned in file
    order; --behind as well is refused, as is a producer that cannot feed its line."""
    sm = flashgen.workload("softmax", M=64, N=2048, dtype="fp32")
    f = tmp_path / "chain.jsonl"
    f.write_text(json.dumps({**sm.to_json(), "behind": BEHIND}) + "\n" + json.dumps(sm.with_dims(M=32).to_json()) + "\n")
    db_path = tmp_path / "t.db"
    code = main(["tune", "--workloads", str(f), "--target", "cpu", "--trials", "2", "--db", str(db_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and "behind rmsnorm M=64 N=2048" in lines[0] and "behind" not in lines[1]
    with Database(db_path) as db:
        target = get_target("cpu")
        assert {r.timing for r in db.records(sm.key, target.id)} == {"behind"}
        assert {r.timing for r in db.records(sm.with_dims(M=32).key, target.id)} == {"alone"}
    assert main(["tune", "--workloads", str(f), "--target", "cpu", "--db", str(db_path),
                 "--behind", json.dumps(BEHIND)]) == 2
    assert "give --behind or those, not both" in capsys.readouterr().err
    f.write_text(json.dumps({**sm.with_dims(N=1000).to_json(), "behind": BEHIND}) + "\n")
    assert main(["tune", "--workloads", str(f), "--target", "cpu", "--db", str(db_path)]) == 2
    assert "but softmax reads x [64, 1000]" in capsys.readouterr().err
