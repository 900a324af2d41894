"""Generated files a person can run: `--out`'s kernel file checks its own kernel on random inputs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flashgen.cli import main


def _run(path, *args):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, str(path), *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("argv, name, rows", [
    (["rmsnorm", "--dim", "M=4096", "--dim", "N=300", "--dtype", "fp16"], "rmsnorm_kernel", "M=5"),
    (["gemm", "--dim", "M=3", "--dim", "N=40", "--dim", "K=72", "--dtype", "fp16"], "gemm_kernel", "M=3"),
])
def test_the_written_kernel_file_runs_checks_and_reports(tmp_path, capsys, argv, name, rows):
    assert main(["compile", *argv, "--target", "h200", "--out", str(tmp_path)]) == 0
    path = tmp_path / f"{name}.py"
    text = path.read_text()
    assert "GRID = (" in text and 'if __name__ == "__main__":' in text
    done = _run(path, rows)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " ok" in done.stdout and "WRONG" not in done.stdout
    assert _run(path, "Q=3").returncode == 2  # not a run-time dim of the op


def test_a_gluon_kernel_file_says_where_it_runs(tmp_path):
    """A Gluon kernel (sm_90 only) refuses Triton's interpreter, and a machine without its GPU, in one line."""
    schedule = ('{"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3, "group_m": 8, '
                '"backend": 1, "producer_warps": 1, "ptx_unpack": 1, "operand_scale": 1}')
    assert main(["compile", "gemm_w4a16", "--dim", "M=16", "--dim", "N=256", "--dim", "K=256", "--dim", "G=128",
                 "--dtype", "fp16", "--target", "h200", "--schedule", schedule, "--out", str(tmp_path)]) == 0
    path = tmp_path / "gemm_w4a16_kernel.py"
    assert "Triton's interpreter does not run Gluon" in path.read_text()
    done = _run(path, "M=4")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "sm_90 GPU" in done.stderr, done.stderr


def test_an_edited_kernel_file_runs_as_edited(tmp_path):
    assert main(["compile", "rmsnorm", "--dim", "M=64", "--dim", "N=96", "--dtype", "fp32", "--target", "h200",
                 "--out", str(tmp_path)]) == 0
    path = tmp_path / "rmsnorm_kernel.py"
    path.write_text(path.read_text().replace("tl.rsqrt(", "tl.sqrt("))
    done = _run(path, "M=4")
    assert done.returncode == 1 and "WRONG" in done.stdout


def test_generated_source_keeps_the_ir_value_names():
    import flashgen
    k = flashgen.compile(flashgen.workload("layernorm", M=8, N=300, dtype="fp16"), target="h200")
    body = k.source.split("def layernorm_kernel", 1)[1]
    for name in ("x", "xc", "ssd"):  # the op's Lets and reductions (flashgen/oplib/norm.py)
        assert f"\n    {name} = " in body, name
    assert "\n    sum = " not in body and "\n    sum_1 = " in body  # a Python builtin's name is not taken
