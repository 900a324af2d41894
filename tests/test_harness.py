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


ATTENTION = ["paged_decode_attention", "--dim", "B=2", "--dim", "Hq=4", "--dim", "Hkv=2", "--dim", "D=64", "--dim", "BS=16",
             "--dim", "NB=8", "--dim", "MAXB=4", "--dim", "L=50"]


def test_a_bf16_dot_kernel_file_refuses_the_interpreter_and_its_fp16_twin_runs(tmp_path):
    """Triton's interpreter multiplies the raw bits of bf16 matrices in tl.dot: run as its header said,
    a right bf16 attention kernel printed WRONG (error 1e10). It is refused in one line saying why,
    and the header no longer suggests the interpreter; the fp16 kernel it points to runs there."""
    assert main(["compile", *ATTENTION, "--dtype", "bf16", "--target", "h200", "--out", str(tmp_path / "bf16")]) == 0
    path = tmp_path / "bf16" / "paged_decode_attention_kernel.py"
    assert "TRITON_INTERPRET" not in path.read_text()
    done = _run(path)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stdout + done.stderr
    assert "interpreter multiplies the raw bits of bf16 matrices in tl.dot" in done.stderr
    assert main(["compile", *ATTENTION, "--dtype", "fp16", "--target", "h200", "--out", str(tmp_path / "fp16")]) == 0
    done = _run(tmp_path / "fp16" / "paged_decode_attention_kernel.py")
    assert done.returncode == 0 and " ok" in done.stdout, done.stdout + done.stderr


def test_a_bf16_kernel_without_a_bf16_dot_still_runs_in_the_interpreter(tmp_path):
    """An int8 GEMM writing bf16 (W8A8) multiplies int8 matrices, which the interpreter computes right."""
    assert main(["compile", "gemm_w8a8", "--dim", "M=3", "--dim", "N=64", "--dim", "K=64", "--dtype", "bf16",
                 "--target", "h200", "--out", str(tmp_path)]) == 0
    path = tmp_path / "gemm_w8a8_kernel.py"
    assert "TRITON_INTERPRET=1 python" in path.read_text()
    done = _run(path)
    assert done.returncode == 0 and " ok" in done.stdout, done.stdout + done.stderr


CALL_IN_INTERPRETER = """
import sys, torch, flashgen
from flashgen.errors import FlashgenError
k = flashgen.compile(flashgen.workload("rmsnorm", M=4, N=64, dtype="fp32"), "h200")  # (from the artifact cache)
try:
    k(torch.randn(4, 64), torch.randn(64))
except FlashgenError as e:
    print(e)
    sys.exit(2)
"""


def test_a_pdl_kernel_called_in_the_interpreter_says_why_it_cannot_run():
    """An h200 kernel waits on the previous kernel through programmatic dependent launch; called on CPU
    tensors under TRITON_INTERPRET=1 it raised Triton's InterpreterError, naming no cause."""
    import flashgen
    kernel = flashgen.compile(flashgen.workload("rmsnorm", M=4, N=64, dtype="fp32"), "h200")  # into the cache
    assert kernel.metadata["constexprs"]["PDL"] == 1
    done = subprocess.run([sys.executable, "-c", CALL_IN_INTERPRETER], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ("this kernel was built for cuda:sm_90/h200 with programmatic dependent launch, which "
                           "Triton's interpreter does not run: call it on its GPU, or build and call it with "
                           "FLASHGEN_PDL=0 set to check it in the interpreter\n")
