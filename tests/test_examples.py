"""The runnable examples run as documented (so that they keep up with the code)."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_new_gpu_example_builds_and_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["new_gpu.py", "--out", str(tmp_path)])
    runpy.run_path(str(EXAMPLES / "new_gpu.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "cuda:sm_89/l40s" in out and out.count("cpu numerics ok") == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemm", "rmsnorm", "rope_cache", "silu_mul"]
    assert (tmp_path / "gemm" / "gemm_kernel.cubin").read_bytes()[:4] == b"\x7fELF"


def test_quickstart_runs_as_written_with_a_cold_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path / "cache"))
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "cubin" in out and ".target sm_90" in out and "max error vs torch" in out
    assert any((tmp_path / "cache").rglob("*"))
