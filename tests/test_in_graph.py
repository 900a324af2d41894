"""benchmarks/studies/in_graph.py's choice of candidates and its rank statistics (the timing itself needs a GPU)."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import flashgen
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets.descriptor import get_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
from in_graph import candidates, ranks, spearman  # noqa: E402


def _rec(us, **knobs):
    s = {"block_m": 1, "block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 3, "group_m": 1, **knobs}
    return SimpleNamespace(schedule=s, latency_us=us)


def test_candidates_keep_the_fastest_and_each_early_load_value():
    """The top schedules by recorded time, a schedule measured twice counted once at its best, and the
    fastest early-load record added when none of the top ones loads early."""
    space = ScheduleSpace(flashgen.workload("gemm", M=1, N=4096, K=4096, dtype="bf16"), get_target("h200"))
    recs = [_rec(13.0), _rec(12.5), _rec(13.2, num_warps=2), _rec(14.0, block_k=1024), _rec(15.0, early_load=1),
            _rec(16.0, early_load=1, num_warps=2), _rec(None, num_warps=8)]
    got = candidates(recs, space, top=2)
    assert [us for _, us in got] == [12.5, 13.2, 15.0]
    assert [space.flat(s)["early_load"] for s, _ in got] == [0, 0, 1]
    assert [s["variant"] for s, _ in got] == ["gemv", "gemv", "gemv_early"] and all(space.is_valid(s) for s, _ in got)
    assert [us for _, us in candidates(recs, space, top=10)] == [12.5, 13.2, 14.0, 15.0, 16.0]
    assert candidates([], space, top=3) == []


def test_rank_statistics():
    assert ranks([3.0, 1.0, 2.0, 1.0]) == [4, 1, 3, 2]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
