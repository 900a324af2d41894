"""GEMM shapes at the edges of the schedule space: refused in one line by rule, or given a valid default."""
from __future__ import annotations

import pytest

import flashgen
from flashgen.cli import main
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target


@pytest.mark.parametrize("k", [200, 496, 513])
def test_fp8_gemm_k_tail_compiles(capsys, tmp_path, k):
    """e4m3 loads zero-fill past K (tests/test_w4fp8.py checks the numerics): K needs no multiple of
    the k step, and the default's k steps run past it."""
    argv = ["compile", "gemm_fp8", "--dim", "M=16", "--dim", "N=256", "--dim", f"K={k}", "--target", "h200"]
    assert main(argv + ["--out", str(tmp_path)]) == 0, capsys.readouterr().err
    assert any(p.suffix == ".cubin" for p in tmp_path.iterdir())


TINY = [("gemm", "h200", dict(M=1, N=n, K=k)) for n in (1, 8, 16) for k in (16, 32, 96)] + \
       [("gemm_w8a8", "h200", dict(M=1, N=5, K=64)), ("gemm_fp8", "h200", dict(M=1, N=16, K=32))] + \
       [(op, "mi300x", dict(M=1, N=n, K=128, G=128)) for op in ("gemm_w4a16", "rmsnorm_gemm_w4a16") for n in (1, 16)]


@pytest.mark.parametrize("op,target,dims", TINY, ids=lambda v: str(v))
def test_tiny_gemv_default_is_valid(op, target, dims):
    """A tile that already covers the whole problem cannot give idle threads more work: it is valid."""
    space = ScheduleSpace(flashgen.workload(op, **dims), get_target(target))
    assert space.is_valid(space.default())


@pytest.mark.parametrize("op,target,dims", [("gemm", "h200", dict(M=1, N=8, K=32)),
                                            ("gemm_w4a16", "mi300x", dict(M=1, N=16, K=128, G=128))])
def test_tiny_gemv_default_numerics(interpreter, op, target, dims):
    wl = flashgen.workload(op, **dims, dtype="fp16")
    schedule = ScheduleSpace(wl, get_target(target)).default()
    checks = interpreter.check(wl, schedule, target, seed=2)
    assert checks and all(c.ok for c in checks), checks


def test_tiny_gemv_compiles_from_the_cli(capsys, tmp_path):
    code = main(["compile", "gemm_w4a16", "--dim", "M=1", "--dim", "N=16", "--dim", "K=128", "--dim", "G=128",
                 "--target", "mi300x", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    assert any(p.suffix == ".hsaco" for p in tmp_path.iterdir())
