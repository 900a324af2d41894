"""Every op's generated Triton kernel, run by Triton's interpreter, against the float64 reference."""
from __future__ import annotations

import pytest

from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from flashgen.workload import domain, workload
from tests.cases import case_id, numerics_cases

CASES = numerics_cases()


def judged(wl, checks):
    """Triton 3.6's interpreter converts fp32 to fp8 e4m3 wrongly when rounding carries into the
    exponent (127.9 -> 64, not 128), so fp8 values are judged on the GPU (tests/test_gpu.py) and only
    their scales here."""
    if wl.attr.get("out_dtype") == "fp8e4m3":
        return [c for c in checks if c.tensor != "q"]
    return checks


@pytest.mark.parametrize("wl", CASES, ids=case_id)
def test_default_schedule(interpreter, wl):
    schedule = ScheduleSpace(wl, get_target("h200")).default()
    checks = judged(wl, interpreter.check(wl, schedule, "h200", seed=len(case_id(wl))))
    assert checks
    for c in checks:
        assert c.ok, (c, schedule)


MULTI = [w for w in numerics_cases(Ms=(3,), Ns=(1000, 5120)) if w.op.kclass == "rowwise" and domain(w)[1] > 256]


@pytest.mark.parametrize("wl", MULTI, ids=case_id)
def test_multi_pass_schedule(interpreter, wl):
    """Rows longer than the tile: one pass per reduction, masked tails (1000 % 256), two rows per program."""
    schedule = {"block_r": 2, "block_c": 256, "num_warps": 1}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(schedule)
    for c in judged(wl, interpreter.check(wl, schedule, "h200", seed=11)):
        assert c.ok, c


@pytest.mark.parametrize("e,topk", [(60, "8"), (128, "2")])
def test_moe_route_multi_pass(interpreter, e, topk):
    """Top-k over a row walked in tiles (outside the GPU spaces, which give rows this short one tile):
    a rank's max and its index each a pass, reading the previous rank's pick."""
    wl = workload("moe_route", M=5, E=e, topk=topk, renorm="no", dtype="bf16")
    checks = interpreter.check(wl, {"block_r": 2, "block_c": 16, "num_warps": 1}, "h200", seed=e)
    assert {c.tensor for c in checks} == {"topk_ids", "topk_weights"}
    for c in checks:
        assert c.ok, c


POINTWISE = [w for w in CASES if w.op.kclass == "pointwise" and 16 < domain(w)[1] < 6000 and w.dim["M"] > 1]


@pytest.mark.parametrize("wl", POINTWISE, ids=case_id)
def test_pointwise_tiles_columns(interpreter, wl):
    """Pointwise ops tile columns too: a tile narrower than the domain spreads a row over programs."""
    schedule = {"block_r": 4, "block_c": 16, "num_warps": 1}
    assert ScheduleSpace(wl, get_target("mi300x")).is_valid(schedule)
    for c in interpreter.check(wl, schedule, "mi300x", seed=5):
        assert c.ok, c


def test_unwritten_output_is_caught(interpreter):
    """A schedule that covers only part of the row must fail the check, not pass on poisoned data."""
    from flashgen.check import compare, poisoned
    from flashgen.workload import workload

    wl = workload("rmsnorm", M=2, N=8, dtype="fp32")
    outs = poisoned(wl, wl.dim, "cpu")
    import torch
    ref = {"y": torch.ones(2, 8, dtype=torch.float64)}
    outs["y"][:, :4] = 1.0
    [c] = compare(wl, outs, ref)
    assert not c.ok and "unwritten" in c.detail
