"""Runner isolation: every way a candidate can fail is recorded with its status, and measuring goes on."""
from __future__ import annotations

import flashgen
from flashgen.schedules.measure import Runner
from flashgen.targets import get_target


def test_failures_are_isolated_and_classified():
    wl = flashgen.workload("rmsnorm", M=4, N=2048, dtype="fp32")
    runner = Runner(get_target("cpu"), devices=["cpu"], timeout_s=3.0, runs=3,
                    factory="tests.faulty:factory", start_timeout_s=60)
    blocks = [16, 32, 64, 16, 128, 256, 512, 1024, 16]
    try:
        results = runner.measure(wl, [{"block_r": 1, "block_c": b, "num_warps": 1} for b in blocks])
    finally:
        runner.close()
    status = [r.status for r in results]
    assert status == ["ok", "crash", "timeout", "ok", "wrong_result", "crash", "compile_error",
                      "wrong_result", "ok"], [(r.status, r.error[:80]) for r in results]
    assert "failed at launch" in results[1].error
    assert "exit code 3" in results[5].error
    assert "unwritten" in results[7].error
    for r in (results[0], results[3], results[8]):
        assert r.latency_us > 0 and r.spread_us >= 0 and r.runs == 3
    assert all(r.latency_us is None for r in results if r.status != "ok")


def test_one_worker_per_device_in_parallel():
    """Several devices: candidates spread over one worker each, results come back in proposal order."""
    import time
    wl = flashgen.workload("rmsnorm", M=4, N=512, dtype="fp32")
    runner = Runner(get_target("cpu"), devices=["cpu", "cpu"], timeout_s=5.0, runs=3,
                    factory="tests.faulty:factory", start_timeout_s=60)
    blocks = [16, 128, 16, 32, 16, 512]
    try:
        runner.measure(wl, [{"block_r": 1, "block_c": 16, "num_warps": 1}])  # start the workers
        t0 = time.perf_counter()
        results = runner.measure(wl, [{"block_r": 1, "block_c": b, "num_warps": 1} for b in blocks])
        elapsed = time.perf_counter() - t0
        started = [w.proc is not None for w in runner.workers]
    finally:
        runner.close()
    assert [r.schedule["block_c"] for r in results] == blocks
    assert [r.status for r in results] == ["ok", "wrong_result", "ok", "crash", "ok", "compile_error"]
    assert started == [True, True] and elapsed < 60  # both devices' workers took candidates
