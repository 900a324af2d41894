"""Runner isolation: every way a candidate can fail is recorded with its status, and measuring goes on."""
from __future__ import annotations

import io

import torch

import flashgen
from flashgen.schedules.measure import Runner
from flashgen.targets import get_target


LONG_S = 600.0  # a timeout no candidate here may reach but a hung one: none of these tests waits it out


def test_failures_are_isolated_and_classified():
    wl = flashgen.workload("rmsnorm", M=4, N=2048, dtype="fp32")
    runner = Runner(get_target("cpu"), devices=["cpu"], timeout_s=LONG_S, runs=3,
                    factory="tests.faulty:factory", start_timeout_s=LONG_S)
    blocks = [16, 32, 16, 128, 256, 512, 1024, 16]
    try:
        results = runner.measure(wl, [{"block_r": 1, "block_c": b, "num_warps": 1} for b in blocks])
    finally:
        runner.close()
    status = [r.status for r in results]
    assert status == ["ok", "crash", "ok", "wrong_result", "crash", "compile_error", "wrong_result", "ok"], \
        [(r.status, r.error[:80]) for r in results]
    assert "failed at launch" in results[1].error
    assert "exit code 3" in results[4].error
    assert "unwritten" in results[6].error
    for r in (results[0], results[2], results[7]):
        assert r.latency_us > 0 and r.spread_us >= 0 and r.runs == 3
    assert all(r.latency_us is None for r in results if r.status != "ok")


def test_a_hung_candidate_is_a_timeout_and_measuring_goes_on():
    """The 1 s timeout applies to the hung candidate alone: the good ones before and after it are each
    the first of a worker (the one the runner starts, then its replacement) that takes 2 s to start up,
    which the start-up timeout covers."""
    wl = flashgen.workload("rmsnorm", M=4, N=2048, dtype="fp32")
    runner = Runner(get_target("cpu"), devices=["cpu"], timeout_s=1.0, runs=3,
                    factory="tests.faulty_slow_start:factory", start_timeout_s=LONG_S)
    try:
        results = runner.measure(wl, [{"block_r": 1, "block_c": b, "num_warps": 1} for b in (16, 64, 16)])
    finally:
        runner.close()
    assert [r.status for r in results] == ["ok", "timeout", "ok"], [(r.status, r.error[:80]) for r in results]
    assert results[1].error == "no answer within 1 s" and results[1].latency_us is None


def test_one_worker_per_device_in_parallel(tmp_path, monkeypatch):
    """Several devices: candidates spread over one worker each, measured at the same time (the first two
    return only once both workers run one), results back in proposal order."""
    monkeypatch.setenv("FLASHGEN_TEST_MEETDIR", str(tmp_path))
    wl = flashgen.workload("rmsnorm", M=4, N=512, dtype="fp32")
    runner = Runner(get_target("cpu"), devices=["cpu", "cpu"], timeout_s=LONG_S, runs=3,
                    factory="tests.faulty:factory", start_timeout_s=LONG_S)
    blocks = [2048, 2048, 128, 32, 16, 512]
    try:
        results = runner.measure(wl, [{"block_r": 1, "block_c": b, "num_warps": 1} for b in blocks])
    finally:
        runner.close()
    assert [r.schedule["block_c"] for r in results] == blocks
    assert [r.status for r in results] == ["ok", "ok", "wrong_result", "crash", "ok", "compile_error"], \
        [(r.status, r.error[:80]) for r in results]
    assert len(list(tmp_path.iterdir())) == 2  # two worker processes met


def _behind_results(factory: str) -> list:
    wl = flashgen.workload("rmsnorm", M=4, N=256, dtype="fp32")
    schedule = {"block_r": 1, "block_c": 16, "num_warps": 1}
    runner = Runner(get_target("cpu"), devices=["cpu"], timeout_s=LONG_S, runs=3, factory=factory,
                    start_timeout_s=LONG_S, behind=(wl, schedule))
    try:
        return runner.measure(wl, [schedule, schedule])
    finally:
        runner.close()


def test_timing_behind_a_producer_of_zero_or_less_is_never_ok():
    """A difference of medians at or under 0 us is re-timed, then recorded as a failure, never as a best."""
    from flashgen.schedules.tuner import Progress, _record
    for factory in ("tests.faulty:zero_timing_factory", "tests.faulty:negative_timing_factory"):
        results = _behind_results(factory)
        for r in results:
            assert r.status != "ok" and r.latency_us is None and "us" in r.error, (factory, r)
        wl = flashgen.workload("rmsnorm", M=4, N=256, dtype="fp32")
        rec = _record(wl, get_target("cpu"), "cpu", results[0], (wl, results[0].schedule))
        assert rec.status != "ok" and rec.latency_us is None
        Progress(wl, 2, 1.0, io.StringIO()).update(results)


def test_behind_cost_retimes_a_difference_of_zero_or_less(monkeypatch):
    from flashgen.schedules import timing
    # (call + producer, producer) medians per round: 0 us, then -1 us, then 2 us apart
    medians = iter([5.0, 5.0, 4.0, 5.0, 7.0, 5.0])
    monkeypatch.setattr(timing, "cpu_time", lambda fn, runs=20: timing.Timing(next(medians), 0.0, runs))
    t = timing.behind_cost(lambda: None, lambda: None, torch.device("cpu"), 0, rounds=1, runs=3)
    assert t.median_us == 2.0 and next(medians, None) is None
    monkeypatch.setattr(timing, "cpu_time", lambda fn, runs=20: timing.Timing(5.0, 0.0, runs))
    assert timing.behind_cost(lambda: None, lambda: None, torch.device("cpu"), 0, rounds=1, runs=3).median_us <= 0
