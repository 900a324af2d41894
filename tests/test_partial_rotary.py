"""Partial rotary (rope_partial, rope_cache_partial) against the formulas the model families use,
written here independently of the op's reference: neox rotates halves of the first R elements
(GPT-NeoX, Phi), gptj interleaved pairs of them (GPT-J); the other D - R elements pass through."""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.errors import FlashgenError
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target

M, HQ, HKV, D, R, L, NS, BASE = 5, 3, 2, 80, 32, 40, 9, 10000.0


def _expected(x: torch.Tensor, pos: torch.Tensor, style: str) -> torch.Tensor:
    """x [M, H, D] float64 with its first R elements rotated at `pos`, frequencies base^(-2i/R)."""
    inv = 1.0 / BASE ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
    ang = pos.double()[:, None, None] * inv
    rot, rest = x[..., :R], x[..., R:]
    if style == "neox":
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        half = torch.cat([-rot[..., R // 2:], rot[..., :R // 2]], -1)
        return torch.cat([rot * cos + half * sin, rest], -1)
    cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
    pairs = torch.stack([-rot[..., 1::2], rot[..., 0::2]], -1).flatten(-2)
    return torch.cat([rot * cos + pairs * sin, rest], -1)


def _inputs(seed: int) -> dict[str, torch.Tensor]:
    from flashgen.oplib.rope import cos_sin_cache
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(M, HQ, D, generator=g), "k": torch.randn(M, HKV, D, generator=g),
            "positions": torch.randint(0, L, (M,), generator=g), "cos_sin": cos_sin_cache(L, R, BASE),
            "v": torch.randn(M, HKV, D, generator=g), "slots": torch.randperm(NS, generator=g)[:M],
            "k_cache": torch.zeros(NS, HKV, D), "v_cache": torch.zeros(NS, HKV, D)}


def _judge(t: dict, outs: dict, style: str) -> None:
    for name, src in (("q_out", "q"), ("k_out", "k")):
        want = _expected(t[src].double(), t["positions"], style)
        torch.testing.assert_close(outs[name].double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(outs[name][..., R:], t[src][..., R:]), "pass-through elements changed"
    assert torch.equal(t["k_cache"][t["slots"]], outs["k_out"]) and torch.equal(t["v_cache"][t["slots"]], t["v"])


def _launch_in_child(wl_json: dict, schedule: dict, t: dict) -> tuple[dict, dict]:
    """The generated kernel under the interpreter; its outputs and the caches it wrote."""
    from flashgen.check import poisoned
    from flashgen.targets.kernel import bind_dims
    from flashgen.targets.triton.codegen import generate
    from flashgen.targets.triton.launch import TritonLauncher
    from flashgen.workload import Workload

    wl = Workload.from_json(wl_json)
    outs = poisoned(wl, wl.dim, "cpu")
    TritonLauncher(generate(wl, schedule), wl, get_target("h200"))({**t, **outs}, {}, bind_dims(wl, t))
    return outs, {n: t[n] for n in ("k_cache", "v_cache")}


def _workload(style: str) -> flashgen.Workload:
    return flashgen.workload("rope_cache_partial", M=M, Hq=HQ, Hkv=HKV, D=D, R=R, L=L, NS=NS, style=style,
                             dtype="fp32")


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_partial_rotary_cpu_op(style):
    from flashgen.runtime.serving.torch_ops import register_all
    register_all()
    t = _inputs(seed=1)
    q_out, k_out = torch.ops.flashgen.rope_cache_partial(*(t[s.name] for s in _workload(style).inputs), style=style)
    _judge(t, {"q_out": q_out, "k_out": k_out}, style)
    q2, k2 = torch.ops.flashgen.rope_partial(t["q"], t["k"], t["positions"], t["cos_sin"], style=style)
    assert torch.equal(q2, q_out) and torch.equal(k2, k_out)


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_partial_rotary_generated_kernel(interpreter, style):
    wl, t = _workload(style), _inputs(seed=2)
    schedule = ScheduleSpace(wl, get_target("h200")).default()
    outs, caches = interpreter.pool.apply(_launch_in_child, (wl.to_json(), schedule, dict(t)))
    _judge({**t, **caches}, outs, style)


@pytest.mark.parametrize("rd,message", [(31, "must be even"), (82, "at most the head dim D=80")])
def test_rotary_dim_is_checked(rd, message):
    with pytest.raises(FlashgenError, match=message):
        flashgen.workload("rope_partial", M=1, Hq=1, Hkv=1, D=80, R=rd, L=8)
