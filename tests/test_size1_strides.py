"""Tensors torch calls contiguous whose size-1 dims have other strides than the canonical ones (a
[N, 1] scale column made as torch.empty(1, N).t(): strides (1, N)) are accepted and computed right:
such a dim is only ever indexed at 0, so its stride never matters."""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

import flashgen
from flashgen.check import OutputCheck
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from flashgen.workload import Workload


def transposed_layout(t: torch.Tensor) -> torch.Tensor:
    """`t` as a transposed buffer when one of its two dims is 1: torch still calls it contiguous."""
    if t.dim() != 2 or 1 not in t.shape:
        return t
    out = torch.empty(t.shape[::-1], dtype=t.dtype).t().copy_(t)
    assert out.is_contiguous() and out.stride() != t.contiguous().stride()
    return out


def _check_in_child(wl_json: dict, schedule: dict, seed: int) -> list[dict]:
    """Interpreter child: the kernel on inputs of transposed size-1 layouts, against the float64 reference."""
    from flashgen.check import check
    from flashgen.targets import staged
    from flashgen.targets.kernel import bind_dims
    from flashgen.targets.triton.codegen import generate
    from flashgen.targets.triton.launch import TritonLauncher

    wl, target = Workload.from_json(wl_json), get_target("h200")
    launcher = staged.launcher(wl, schedule, target, lambda w, s: TritonLauncher(generate(w, s), w, target))

    def run(inputs, outputs, params):
        inputs = {k: transposed_layout(v) for k, v in inputs.items()}
        assert inputs["scales"].stride() == (1, wl.dim["N"])
        launcher({**inputs, **outputs}, params, bind_dims(wl, inputs))

    return [asdict(c) for c in check(wl, run, seed)]


@pytest.mark.parametrize("m", [1, 5])
def test_w4a16_per_channel_scales_with_size1_strides(interpreter, m):
    """Per-channel scales [N, 1] with strides (1, N), and at M = 1 an x [1, K] with strides (1, 1) (its
    row stride promised divisible by 16 in the binary): fp16 numerics against float64, N and K tails."""
    wl = flashgen.workload("gemm_w4a16", M=m, N=40, K=320, G=320, group="channel", dtype="fp16")
    space = ScheduleSpace(wl, get_target("h200"))
    s = space.complete({"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 2, "group_m": 8})
    assert space.is_valid(s)
    for c in (OutputCheck(**r) for r in interpreter.pool.apply(_check_in_child, (wl.to_json(), s, m))):
        assert c.ok, c


def test_cpu_kernel_takes_a_row_with_size1_strides():
    """The cpu target's kernels (TVM) on a [1, N] row made as torch.empty(N, 1).t(): strides (1, 1)."""
    from flashgen.runtime import register_all

    register_all()
    g = torch.Generator().manual_seed(3)
    x, w = transposed_layout(torch.randn(1, 577, generator=g)), torch.randn(577, generator=g)
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    got = torch.ops.flashgen.rmsnorm(x, w, 1e-5)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


def as_qkv_columns(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q, k and v as the decoder passes them: views of one fused [M, (Hq + 2 Hkv) * D] qkv output."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    m, d = q.shape[0], q.shape[2]
    qkv = torch.cat([t.reshape(m, -1) for t in (q, k, v)], dim=1)
    nq, nk = q.shape[1] * d, k.shape[1] * d
    views = {"q": qkv[:, :nq], "k": qkv[:, nq:nq + nk], "v": qkv[:, nq + nk:]}
    return {**inputs, **{n: t.reshape(m, -1, d) for n, t in views.items()}}


def _rope_cache_in_child(wl_json: dict, seed: int) -> list[dict]:
    """Interpreter child: rope_cache on q, k, v viewed in a fused qkv output, against float64."""
    from flashgen.check import check
    from flashgen.targets.kernel import bind_dims
    from flashgen.targets.triton.codegen import generate
    from flashgen.targets.triton.launch import TritonLauncher

    wl, target = Workload.from_json(wl_json), get_target("h100")
    launcher = TritonLauncher(generate(wl, ScheduleSpace(wl, target).default()), wl, target)

    def run(inputs, outputs, params):
        inputs = as_qkv_columns(inputs)
        assert wl.dim["M"] == 1 or not inputs["q"].is_contiguous()
        launcher({**inputs, **outputs}, params, bind_dims(wl, inputs))

    return [asdict(c) for c in check(wl, run, seed)]


@pytest.mark.parametrize("m", [1, 5])
def test_rope_cache_takes_q_k_v_as_columns_of_the_qkv_output(interpreter, m):
    """The decoder hands rope_cache its q, k and v as column views of the qkv GEMM's output (no copies):
    the GPU kernel (interpreted) and the CPU's compute them as on contiguous tensors."""
    wl = flashgen.workload("rope_cache", M=m, Hq=4, Hkv=2, D=64, L=32, NS=24, dtype="bf16", style="neox")
    for c in (OutputCheck(**r) for r in interpreter.pool.apply(_rope_cache_in_child, (wl.to_json(), m))):
        assert c.ok, c
    from flashgen.check import check
    from flashgen.runtime import register_all

    register_all()
    cpu = flashgen.compile(wl, get_target("cpu"))
    for c in check(wl, lambda i, o, p: cpu.run(as_qkv_columns(i), o, p), m):
        assert c.ok, c
