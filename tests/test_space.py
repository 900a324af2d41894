"""Schedule spaces: the analytic default is a valid point of the space for every op, shape and target."""
from __future__ import annotations

import pytest

import flashgen
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import load_targets


def _workloads():
    for m in (1, 3, 64, 1000, 16384):
        for n in (1, 17, 127, 4096, 11008, 65536):
            for op in ("rmsnorm", "softmax", "silu_mul", "dynamic_quant"):
                yield flashgen.workload(op, M=m, N=n, dtype="fp16")
        yield flashgen.workload("rope", M=m, Hq=40, Hkv=8, D=128, L=8192, dtype="bf16")


@pytest.mark.parametrize("target", sorted(load_targets()))
def test_default_is_valid_everywhere(target):
    t = load_targets()[target]
    for wl in _workloads():
        space = ScheduleSpace(wl, t)
        s = space.default()
        assert space.why_invalid(s) is None, (wl, s)


def test_space_points_are_valid_and_distinct():
    wl = flashgen.workload("rmsnorm", M=4096, N=5120, dtype="bf16")
    space = ScheduleSpace(wl, load_targets()["cuda:sm_90/h200"])
    points = list(space)
    assert len(points) == len({tuple(sorted(p.items())) for p in points}) > 20
    assert space.default() in points
    assert not space.is_valid({"block_r": 1, "block_c": 64, "num_warps": 1})   # tiny tile over a long row
    assert not space.is_valid({"block_r": 1, "block_c": 8192, "num_warps": 64})
