"""gemm_w4fp8: w4a16's int4 codes and group scales times per-token e4m3 activations on fp8 tensor
cores. Numerics of its Triton forms in the interpreter (the PTX-unpacked ones run on the GPU:
tests/test_gpu.py), its sm_90 build, its schedule space and the decoder's w4fp8 mode on the CPU."""
from __future__ import annotations

import re

import pytest
import torch

import flashgen
from flashgen.errors import FlashgenError
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from tests.cases import form_schedules

# (M, attrs and dims): one row, row tails, groups of 32, 64 and 128, per channel, K tails past a block of 128
SHAPES = [(1, dict(G=128, K=384)), (3, dict(G=64, K=576)), (17, dict(G=128, K=384)), (5, dict(G=32, K=256)),
          (17, dict(G=320, K=320, group="channel"))]
PTX_FORMS = ("gemv_ptx", "gemv_ptx_quad", "gemv_ptx_early", "gemv_ptx_quad_early", "tile_ptx")


@pytest.mark.parametrize("m, kw", SHAPES, ids=[f"m{m}-" + "-".join(map(str, kw.values())) for m, kw in SHAPES])
def test_interpreter_numerics_every_form(interpreter, m, kw):
    """Every form the space offers that the interpreter runs (no inline PTX), against the float64
    reference of the e4m3 activations times the dequantized weight."""
    wl = flashgen.workload("gemm_w4fp8", M=m, N=40, dtype="fp16", **kw)
    forms = {f: s for f, s in form_schedules(ScheduleSpace(wl, get_target("h200"))).items() if f not in PTX_FORMS}
    assert {"tile"} <= set(forms), forms
    for form, s in forms.items():
        checks = interpreter.check(wl, s, "h200", seed=m)
        assert checks and all(c.ok for c in checks), (form, checks)


def test_fp8_loads_zero_fill_past_k(interpreter):
    """Masked e4m3 loads read zeros past K (their bytes zero-filled, then reinterpreted): gemm_fp8 takes
    K = 200 under 64-deep k steps, which once had to divide K."""
    wl = flashgen.workload("gemm_fp8", M=3, N=40, K=200, dtype="fp16")
    s = {"block_m": 16, "block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2, "group_m": 1}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s)
    checks = interpreter.check(wl, s, "h200", seed=4)
    assert checks and all(c.ok for c in checks), checks


def test_sm90_build_feeds_fp8_warpgroup_mma_from_registers():
    """At 256 rows the codes are unpacked in fp16 pairs, converted two per instruction to e4m3, and
    enter the warpgroup MMA as its register operand (the activations from shared memory)."""
    wl = flashgen.workload("gemm_w4fp8", M=256, N=4096, K=4096, G=128, dtype="bf16")
    space = ScheduleSpace(wl, get_target("h100"))
    for form in ("tile", "tile_ptx"):
        k = flashgen.compile(wl, "h100", schedule=space.with_knob(space.default(), "variant", form))
        ptx = k.asm["ptx"]
        mma = re.findall(r"wgmma\.mma_async\S*e4m3\.e4m3 \{[^}]*\}, \{", ptx)
        assert mma, form  # the A operand a register list, not a shared-memory descriptor
        assert "cvt.rn.satfinite.e4m3x2.f16x2" in ptx and k.binary[:4] == b"\x7fELF"


def test_space_offers_no_scaled_or_gluon_forms():
    """Scaled codes would round to e4m3's 4 significant bits, and the Gluon int4 tiles take 16-bit
    activations: neither is offered; the matrix and GEMV int4 forms are."""
    wl = flashgen.workload("gemm_w4fp8", M=64, N=4096, K=4096, G=128, dtype="bf16")
    forms = set(ScheduleSpace(wl, get_target("h100")).forms())
    assert {"tile", "tile_ptx"} <= forms and not any("scaled" in f or f.startswith("gluon") for f in forms), forms
    gemv = set(ScheduleSpace(wl.with_dims(M=1), get_target("h100")).forms())
    assert {"gemv", "gemv_ptx_quad"} <= gemv


@pytest.mark.parametrize("target", ["sm_80", "gfx942"])
def test_targets_without_fp8_refuse(target):
    wl = flashgen.workload("gemm_w4fp8", M=16, N=256, K=256, G=128, dtype="bf16")
    with pytest.raises(FlashgenError, match="does not support fp8e4m3"):
        flashgen.compile(wl, target)


def test_decoder_mode_keeps_w4a16_weights_and_quantizes_activations_to_e4m3():
    """w4fp8 keeps w4a16's codes and scales; on the CPU its product is the e4m3 activations (per token)
    times the dequantized weight, within e4m3's rounding of the float product."""
    from flashgen.oplib._common import quantize_ref
    from flashgen.oplib.gemm import int4_weight
    from flashgen.runtime.decoder.quant_modes import W4A16Linear, prepare, quant_mode

    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=g)
    x = torch.randn(5, 256, generator=g)
    q, ref4 = prepare(w, "w4fp8"), W4A16Linear.prepare(w)
    assert quant_mode("w4fp8").activations == "fp8e4m3"
    assert torch.equal(q.w4.w4, ref4.w4) and torch.equal(q.w4.w4_scales, ref4.w4_scales)
    xq, xs = quantize_ref(x.double(), "fp8e4m3")
    want = (xq * xs[:, None]).to(x.dtype).double() @ int4_weight(ref4.w4, ref4.w4_scales, 256).T
    got = q.cpu_product(x, None).double()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    exact = x.double() @ w.double().T
    rel = (got - exact).norm() / exact.norm()
    assert 0.01 < rel < 0.2, rel  # int4 and e4m3 rounding: visible, bounded
