"""Generated kernels on the running GPU against the float64 reference (run on the device: -m gpu)."""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.check import check
from flashgen.schedules.space import ScheduleSpace
from tests.cases import case_id, numerics_cases

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from flashgen.targets import target_for_device  # noqa: E402
from flashgen.targets.triton.launch import device_arch  # noqa: E402

DEVICE = torch.device("cuda")
TARGET = target_for_device(torch.cuda.get_device_name(), device_arch(DEVICE))
CASES = [wl for wl in numerics_cases(Ms=(1, 3, 17, 1000)) if all(
    wl.tensor_dtype(t.name) in TARGET.dtypes for t in wl.op.outputs)]


def _run(kernel):
    return lambda inputs, outputs, params: kernel.run(inputs, outputs, params)


@pytest.mark.parametrize("wl", CASES, ids=case_id)
def test_default_schedule_on_gpu(wl):
    kernel = flashgen.compile(wl, TARGET, db=None)
    for seed in (0, 1):
        for c in check(wl, _run(kernel), seed, DEVICE):
            assert c.ok, (c, kernel.schedule)


@pytest.mark.parametrize("wl", [w for w in CASES if w.op.kclass == "rowwise" and w.dim["N"] > 300],
                         ids=case_id)
def test_multi_pass_schedule_on_gpu(wl):
    schedule = {"block_r": min(2, wl.dim["M"]), "block_c": 256, "num_warps": 2}
    assert ScheduleSpace(wl, TARGET).is_valid(schedule)
    kernel = flashgen.compile(wl, TARGET, schedule=schedule)
    for c in check(wl, _run(kernel), 7, DEVICE):
        assert c.ok, c


def test_row_count_differs_from_compiled():
    wl = flashgen.workload("rmsnorm", M=64, N=4096, dtype="bf16")
    kernel = flashgen.compile(wl, TARGET)
    for m in (1, 63, 1000):
        for c in check(wl.with_dims(M=m), _run(kernel), m, DEVICE):
            assert c.ok, (m, c)
