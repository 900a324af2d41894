"""4-bit weights whose K is no multiple of 128 (SmolLM2's hidden size, 576 = 4.5 x 128): the decoder's
linears quantize them in groups of 64 (or 32) rather than per channel, and every int4 GEMM form the
ScheduleSpace offers for such groups computes right (Triton's interpreter, float64 references) and
builds ahead of time for sm_90; the forms that pair codes across a block of 128 k are not offered."""
from __future__ import annotations

import random

import pytest
import torch

import flashgen
from flashgen.ir.variants import VARIANTS
from flashgen.quant import quantize_rtn, quantize_w4a8
from flashgen.runtime import register_all
from flashgen.schedules.contraction_space import flat_of
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from tests.cases import INT4_K576_OPS as INT4_OPS
from tests.cases import form_schedules

K = 576  # 4.5 blocks of 128 k: the last block of packed words is half padding
# forms that need a block of 128 k to share one scale: PTX-unpacked GEMV tiles (codes 64 k apart in
# one pair), scales multiplied into the code pairs, and the Gluon int4 tile (one scale per k step)
BLOCK_GROUP_FORMS = {"gemv_ptx", "gemv_ptx_quad", "gemv_ptx_early", "gemv_ptx_quad_early", "tile_ptx_scaled",
                     "gluon_int4"}


def _ids(cases) -> list[str]:
    return [f"{op}-{'-'.join(kw.values()) or 'sym'}-G{g}-M{m}" for op, kw, g, m in cases]


@pytest.mark.parametrize("mode", ["w4a16", "w4a8", "mixed"])
def test_decoder_linears_of_k576_take_groups_of_64(mode):
    """A linear's group is the largest of 128, 64 and 32 dividing K (per channel where none does), and
    the GEMM the decoder launches (runtime/decoder/calls.py) carries it; the CPU product is the weight
    quantized in those groups."""
    from flashgen.runtime.decoder.calls import gemm_workload
    from flashgen.runtime.decoder.linear import apply
    from flashgen.runtime.decoder.quant_modes import _group, prepare
    register_all()  # (the CPU's int8 product quantizes x by the generated dynamic_quant op)
    assert [_group(k) for k in (4096, 1536, K, 96, 200)] == [128, 128, 64, 32, 200]
    g = torch.Generator().manual_seed(57)
    w, x = torch.randn(40, K, generator=g), torch.randn(5, K, generator=g)
    q = prepare(w, mode)
    linears = list(q.choices.values()) if mode == "mixed" else [q]
    fourbit = [lin for lin in linears if lin.mode in ("w4a16", "w4a8")]
    assert len(fourbit) == (2 if mode == "mixed" else 1)
    for lin in fourbit:
        assert lin.group == 64
        scales = lin.w4_scales if lin.mode == "w4a16" else lin.w4a8_group
        assert scales.shape == (40, K // 64)
        for rows in (1, 5):
            wl = gemm_workload(lin, rows, torch.bfloat16)
            assert (wl.op_name, wl.dim["G"], wl.attr["group"]) == (f"gemm_{lin.mode}", 64, "group")
    for lin in fourbit:  # the CPU product: x times the weight quantized in groups of 64
        y = apply(x, lin, None, set()).double()
        if lin.mode == "w4a8":  # w4a8's int8 operand, as gemm_w4a8 multiplies it
            assert torch.equal(lin.w4a8_int8, quantize_w4a8(w, 64).operand())
            continue
        dq = quantize_rtn(w, bits=4, group=64).dequantize() if mode == "w4a16" else quantize_w4a8(w, 64).dequantize()
        ref = x.double() @ dq.T
        assert (y - ref).norm() < 1e-6 * ref.norm()  # (float32 weights and sums)


NUMERICS = [(op, kw, g, m) for op, kw in INT4_OPS[:4] for g, m in ((64, 1), (32, 5))]  # (each op at both groups)


@pytest.mark.parametrize("op, kw, g, m", NUMERICS, ids=_ids(NUMERICS))
def test_int4_forms_numerics_at_k576(interpreter, op, kw, g, m):
    """One schedule of each form the h200 space offers (`form_schedules`), against the op's float64
    reference on fresh inputs, two seeds; N=40 leaves a partial column tile. PTX-unpacked and Gluon
    tiles run on the GPU (tests/test_gpu.py `test_int4_groups_of_k576_on_gpu`, `test_gluon_lanes_tiles_on_gpu`):
    the interpreter runs neither."""
    wl = flashgen.workload(op, M=m, N=40, K=K, G=g, dtype="fp16", **kw)
    forms = {f: s for f, s in form_schedules(ScheduleSpace(wl, get_target("h200"))).items()
             if not flat_of(wl, s)["ptx_unpack"] and not flat_of(wl, s)["backend"]}
    lanes = kw.get("pack") == "lanes"  # (`lanes` codes: matrix tiles are lanes tiles)
    assert {"gemv", "tile_lanes" if lanes else "tile"} <= set(forms) and ("tile" in forms) != lanes, sorted(forms)
    for s in forms.values():
        checks = interpreter.check(wl, s, "h200", [g + m, g + m + 1])
        assert checks and all(c.ok for c in checks), (s, checks)


FUSED = [("rmsnorm_gemm_w4a16", {}, 64, 5), ("silu_mul_gemm_w4a16", {}, 32, 1)]


@pytest.mark.parametrize("op, kw, g, m", FUSED, ids=_ids(FUSED))
def test_fused_prologue_forms_numerics_at_k576(interpreter, op, kw, g, m):
    """The norm and the gate fused into the int4 GEMM's A tile, GEMV and matrix tiles, groups of 64 and 32."""
    wl = flashgen.workload(op, M=m, N=40, K=K, G=g, dtype="fp16", **kw)
    forms = form_schedules(ScheduleSpace(wl, get_target("h200")))
    for form in ("gemv", "tile"):
        checks = interpreter.check(wl, forms[form], "h200", [m])
        assert checks and all(c.ok for c in checks), (forms[form], checks)


def test_dequant_first_numerics_at_k576(interpreter):
    """The weight dequantized first (groups of 64; w4a8's lanes codes in groups of 32), then the dense
    op's tiles: M=515 leaves a partial row tile."""
    for op, kw, g in (("gemm_w4a16", {}, 64), ("gemm_w4a8", {"pack": "lanes"}, 32)):
        wl = flashgen.workload(op, M=515, N=40, K=K, G=g, dtype="fp16", **kw)
        space = ScheduleSpace(wl, get_target("h200"))
        s = space.with_knob(space.default(), "variant", "dq_tile")
        s = {**s, "block_m": 64, "block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 2}
        assert space.is_valid(s), space.why_invalid(s)
        checks = interpreter.check(wl, s, "h200", [3])
        assert checks and all(c.ok for c in checks), (op, checks)


SPACES = [(op, kw, g, m) for op, kw in INT4_OPS for g in (64, 32) for m in (1, 5, 16, 256, 4096)]


@pytest.mark.parametrize("target", ["h200", "h100"])
def test_space_offers_no_block_group_form(target):
    """For groups of 64 and 32, the space leaves out the forms that need a block of 128 k to share one
    scale, at every regime, and its rules refuse such schedules when given; the default is valid, and
    no schedule the space yields (a random sample of its points that pass the rules) unpacks GEMV
    codes in PTX or scales code pairs (lanes tiles scale int8 lanes by any group of whole 32-k blocks)."""
    t = get_target(target)
    rng = random.Random(576)
    for op, kw, g, m in SPACES:
        wl = flashgen.workload(op, M=m, N=1536, K=K, G=g, dtype="bf16", **kw)
        space = ScheduleSpace(wl, t)
        assert not BLOCK_GROUP_FORMS & set(space.forms()), (op, kw, g, m, sorted(space.forms()))
        assert space.is_valid(space.default())
        for _ in range(300):
            s = space.sample(rng)
            if space.is_valid(s):
                f = flat_of(wl, s)
                assert not (f["ptx_unpack"] and f["block_m"] < 16) and not (f["operand_scale"] and not f["lanes"]), s
        if m <= 16 and op != "gemm_w4a8":
            assert "groups must span 128" in space.why_invalid(
                {"variant": "gemv_ptx", "block_m": 1, "block_n": 16, "block_k": 1024, "num_warps": 4, "num_stages": 1,
                 "split_k": 1, "persistent": 0})
    # the same workloads with groups of 128 (K = 640) do offer them: the rule is the groups', not K's
    wide = ScheduleSpace(flashgen.workload("gemm_w4a16", M=1, N=1536, K=640, G=128, dtype="bf16"), t)
    assert {"gemv_ptx", "gemv_ptx_quad"} <= set(wide.forms())
    assert VARIANTS.keys() >= BLOCK_GROUP_FORMS


AOT = [(op, kw, 64, m) for op, kw in INT4_OPS for m in (1, 5, 256, 4096)]


def test_default_schedules_build_for_sm90_at_g64():
    """The default schedule of every int4 op at K=576, groups of 64, builds ahead of time for sm_90
    (no GPU: PTX and cubin), at each regime (GEMV, matrix tiles, a weight dequantized first)."""
    for op, kw, g, m in AOT:
        wl = flashgen.workload(op, M=m, N=1536, K=K, G=g, dtype="bf16", **kw)
        k = flashgen.compile(wl, "sm_90", db=None)
        assert k.metadata["schedule_source"] == "analytic default" and k.binary, (op, kw, m)
        assert k.metadata["schedule"] == ScheduleSpace(wl, get_target("sm_90")).default()
