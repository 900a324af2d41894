"""gemm_w4a8's weights and error: the two-level quantizer keeps (u - 8) * s_group an int8, and the
GEMM's error against the float product stays within the bound its two roundings give.

The bound (per output element): with x = x_q * x_scale + dx (|dx| <= x_scale / 2) and w = w_q + dw
(|dw| <= half the weight's step s_channel * s_group), the float product x . w and the quantized one
x_q * x_scale . w_q differ by at most sum_k |x_k| |dw_k| + |dx_k| |w_q,k|; the int8 tensor cores sum
the quantized product exactly in int32, so the kernel adds only the fp32 scaling and its output dtype's
rounding.
"""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.errors import FlashgenError
from flashgen.oplib._common import quantize_ref
from flashgen.quant import (LANE_MASK, W4A8_GROUP_MAX, pack_int4, pack_int4_lanes, packed_words, quantize_rtn,
                           quantize_w4a8, unpack_int4_lanes)
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target


def _step(q) -> torch.Tensor:
    s = q.channel_scales.double()[:, None].expand(q.codes.shape)
    return s * q.group_scales.double().repeat_interleave(q.group, 1) if q.group_scales is not None else s


@pytest.mark.parametrize("group", [32, 128, None])
def test_codes_stay_int8_and_within_half_a_step(group):
    w = torch.randn(24, 384, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 3, 384)
    q = quantize_w4a8(w, group)
    assert q.codes.min() >= 0 and q.codes.max() <= 15
    step = _step(q)
    assert ((q.dequantize() - w.double()).abs() <= step / 2 + 1e-7 * step).all()
    if group is None:
        assert q.group_scales is None and q.group == 384
        return
    sg = q.group_scales.to(torch.int32)
    assert sg.min() >= 1 and sg.max() <= W4A8_GROUP_MAX
    w8 = (q.codes.to(torch.int32) - 8) * sg.repeat_interleave(group, 1)
    assert w8.min() >= -128 and w8.max() <= 127  # the int8 operand of the matrix instruction
    assert torch.equal(q.operand().to(torch.int32), w8)
    # a group's step is its W4A16 step (amax / 7) rounded up to a multiple of the channel scale
    rtn = quantize_rtn(w, 4, group).scales.double().repeat_interleave(group, 1)
    assert (step <= rtn + q.channel_scales.double()[:, None] * (1 + 1e-6)).all()


def test_quantizer_rejects_bad_groups():
    with pytest.raises(FlashgenError, match="multiple of the group size 96"):
        quantize_w4a8(torch.randn(4, 128), 96)


@pytest.mark.parametrize("m, n, k, group", [(1, 40, 256, 64), (19, 33, 384, 128), (5, 48, 320, None)])
def test_kernel_error_within_the_quantization_bound(interpreter, m, n, k, group):
    """The generated kernel (Triton's interpreter, fp16 output) against the float64 product of the
    unquantized x and w: within the bound of the module docstring plus fp16's rounding of the output."""
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64) / k ** 0.5
    xq, xs = quantize_ref(x, "int8")
    q = quantize_w4a8(w, group)
    wq = q.dequantize()
    bound = x.abs() @ (_step(q) / 2).T + (xs[:, None] / 2).expand(m, k) @ wq.abs().T
    exact = x @ w.T
    assert ((xq * xs[:, None]) @ wq.T - exact).abs().le(bound * (1 + 1e-9)).all()
    grouped = group is not None
    wl = flashgen.workload("gemm_w4a8", M=m, N=n, K=k, G=group or k, dtype="fp16",
                           group="group" if grouped else "channel")
    s = {"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 2, "group_m": 1}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s)
    tensors = {"x": xq.to(torch.int8), "x_scale": xs.float(), "w_packed": pack_int4(q.codes), "w_scale": q.channel_scales}
    if grouped:
        tensors["w_group"] = q.group_scales
    [y] = interpreter.run(wl, s, "h200", tensors).values()
    err = (y.double() - exact).abs()
    assert (err <= bound + exact.abs() * 2 ** -10 + 1e-6).all(), (err - bound).max()
    # in norm, W4A8 is about as accurate as W4A16 (round-to-nearest, same groups, 16-bit x): the int8
    # activations and the integer group scales add 0-12% here
    rtn = x @ quantize_rtn(w, 4, group).dequantize().T
    assert (y.double() - exact).norm() <= 1.25 * (rtn - exact).norm()


# The `lanes` layout (flashgen/quant.py pack_int4_lanes) and its matrix tiles (targets/triton/contraction/int8_lanes.py).

@pytest.mark.parametrize("n, k", [(1, 32), (3, 200), (7, 4096), (2, 131)])
def test_lanes_pack_round_trips_exactly(n, k):
    g = torch.Generator().manual_seed(n * k)
    codes = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
    packed = pack_int4_lanes(codes)
    assert packed.dtype == torch.int32 and packed.shape == (n, packed_words(k))
    assert torch.equal(unpack_int4_lanes(packed, k), codes)
    # one AND (and a shift by 4 first) of word 4b + t gives the int8 lanes (u - 8) * 16 of k = 32b + 4t + i
    # and 32b + 16 + 4t + i, i = 0..3: the bytes of the masked word, read as int8
    words = packed.to(torch.int64) & 0xFFFFFFFF
    lanes = [words & LANE_MASK, (words << 4) & LANE_MASK]
    byte = [torch.stack([((v >> (8 * i)) & 255) for i in range(4)], -1) for v in lanes]  # [n, word, i]
    byte = [torch.where(b >= 128, b - 256, b).reshape(n, -1, 4, 4) for b in byte]  # [n, block, t, i]
    want = torch.zeros(n, packed_words(k) * 8, dtype=torch.int64)
    want[:, :k] = (codes.to(torch.int64) - 8) * 16  # padding: zero nibbles, zero lanes
    want = want.reshape(n, -1, 2, 4, 4)  # [n, block, h, t, i]
    assert torch.equal(byte[0], want[:, :, 0]) and torch.equal(byte[1], want[:, :, 1])


def test_lanes_pack_rejects_bad_input():
    with pytest.raises(FlashgenError, match="0..15"):
        pack_int4_lanes(torch.full((2, 32), 16, dtype=torch.uint8))
    with pytest.raises(FlashgenError, match="do not pack K=256"):
        unpack_int4_lanes(torch.zeros(2, 16, dtype=torch.int32), 256)


@pytest.mark.parametrize("group", ["group", "channel"])
def test_lanes_dequant_evaluates_the_layout(interpreter, group):
    """The IR's per-element meaning of the layout (prologue.int4_lane, what generic tiles and the
    dequant-first form evaluate) against the packer's inverse: dequant_w4a8's int8 operand, odd N and K."""
    wl = flashgen.workload("dequant_w4a8", N=37, K=160, G=32 if group == "group" else 160, group=group, pack="lanes")
    checks = interpreter.check(wl, ScheduleSpace(wl, get_target("h200")).default(), "h200", [1, 2])
    assert checks and all(ch.ok and ch.error == 0 for ch in checks), checks


LANES = {"variant": "tile_lanes", "block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 2,
         "split_k": 1, "persistent": 0}


LANES_NUMERICS = [
    (1, 40, 256, 128, {}),                                   # one row, a column tail
    (19, 48, 384, 64, {"group_m": 1}),                       # two groups per k step, a row tail
    (5, 33, 512, 256, {"block_k": 64, "split_k": 2}),        # a quarter group per k step, split K
    (3, 24, 200, None, {"block_k": 64}),                     # per channel, a k tail (200 = 3 * 64 + 8)
    (17, 40, 160, 32, {"block_m": 32, "block_k": 64, "group_m": 1}),  # groups of 32, a k tail
]


@pytest.mark.parametrize("m, n, k, g, s", LANES_NUMERICS + [
    # lanes times their group scale before the instruction: the same shapes in groups, and a k step
    # half past K (K = 192 under 128-deep steps: its second group's lanes and scale masked to zero)
    *[(m, n, k, g, {**s, "variant": "tile_lanes_scaled"}) for m, n, k, g, s in LANES_NUMERICS if g],
    (7, 56, 192, 64, {"variant": "tile_lanes_scaled", "block_k": 128}),
])
def test_lanes_tile_numerics(interpreter, m, n, k, g, s):
    """The lanes tiles (Triton's interpreter) against the float64 reference on fresh inputs: the sums
    are exact in int32, so the error is the fp32 scaling and fp16 rounding of the output alone."""
    wl = flashgen.workload("gemm_w4a8", M=m, N=n, K=k, G=g or k, dtype="fp16", group="group" if g else "channel",
                           pack="lanes")
    space = ScheduleSpace(wl, get_target("h200"))
    form = s.get("variant", "tile_lanes")
    sched = {kk: v for kk, v in {**LANES, **s}.items() if kk in space.forms()[form] or kk == "variant"}
    assert space.is_valid(sched), space.why_invalid(sched)
    checks = interpreter.check(wl, sched, "h200", [m + 1, m + 2])
    assert checks and all(ch.ok and ch.error <= 2 ** -10 for ch in checks), checks


def test_lanes_codes_are_read_by_lanes_tiles_or_dequantized_first():
    """A generic matrix tile that unpacks `lanes` codes in its prologue is refused (on an H100 it took
    1192-5019 us at 64 rows, the lanes tiles 11-37): the same tile as a lanes tile, the weight
    dequantized first, and the analytic default stay."""
    h100 = get_target("h100")
    for m in (64, 256, 4096):
        wl = flashgen.workload("gemm_w4a8", M=m, N=4096, K=4096, G=128, dtype="bf16", pack="lanes")
        space = ScheduleSpace(wl, h100)
        tile = {"block_m": 64, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3, "group_m": 8,
                "split_k": 1, "persistent": 0}
        assert "read by lanes tiles" in space.why_invalid({**tile, "variant": "tile"})
        assert space.is_valid({**tile, "variant": "tile_lanes"}), space.why_invalid({**tile, "variant": "tile_lanes"})
        assert space.is_valid(space.default()), space.why_invalid(space.default())
    staged = ScheduleSpace(flashgen.workload("gemm_w4a8", M=4096, N=4096, K=4096, G=128, dtype="bf16", pack="lanes"),
                           h100)
    assert any(s["variant"].startswith("dq_") for s in staged)


@pytest.mark.parametrize("k", [256, 200])  # groups of 128, and per channel
def test_w4a8_linears_pack_lanes_at_load_and_call_the_op_with_them(k):
    """W4A8Linear (and mixed's w4a8) pack the codes once in the lanes layout and call gemm_w4a8 with
    pack=lanes: the op's reference on the linear's tensors is the CPU's exact integer product."""
    from flashgen.runtime.decoder.quant_modes import MixedLinear, W4A8Linear
    w = torch.randn(48, k, generator=torch.Generator().manual_seed(k))
    qa = quantize_w4a8(w, 128 if k % 128 == 0 else None)
    xq, xs = quantize_ref(torch.randn(3, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64), "int8")
    for lin in (W4A8Linear.prepare(w), MixedLinear.prepare(w).choices["w4a8"]):
        assert torch.equal(unpack_int4_lanes(lin.w4, k), qa.codes)
        calls = []

        class Ops:
            def gemm_w4a8(self, *args, **kw):
                calls.append((args, kw))

        lin.quantized_gemm(Ops(), xq.to(torch.int8), xs.float(), "bf16", {})
        [(args, kw)] = calls
        assert kw["pack"] == "lanes"
        wl = flashgen.workload("gemm_w4a8", M=3, N=48, K=k, G=kw["dims"][3], group=kw["group"], pack=kw["pack"], dtype="bf16")
        t = dict(zip(("x", "x_scale", "w_packed", "w_scale"), args), **({"w_group": kw["w_group"]} if "w_group" in kw else {}))
        [y] = wl.op.reference(t, wl.op.params, wl.dim, wl.attr).values()
        exact = (xq @ lin.w4a8_int8.double().T) * xs[:, None] * lin.w4a8_scale.double()
        torch.testing.assert_close(y, exact, rtol=1e-6, atol=0)  # (float32 scales, float64 products)


def test_lanes_tiles_build_ahead_of_time_with_fewer_unpack_instructions():
    """The lanes tile builds for sm_90 (warpgroup int8 MMA), sm_80 (IMMA) and gfx942 (MFMA) without a
    GPU; on sm_90 its k loop (one 128-deep step of a 128 x 128 tile, groups of 128) takes fewer than
    two thirds of the instructions of the k128 layout's integer unpack (543 -> 296 at this commit:
    PRMT 196 -> 26, LOP3 84 -> 16 for 64 codes per thread), and no shared-memory stores; with the
    group scales in the lanes (tile_lanes_scaled) fewer still."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import loop_opcodes

    s = {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3, "group_m": 8, "split_k": 1,
         "persistent": 0}
    old = flashgen.workload("gemm_w4a8", M=256, N=4096, K=4096, G=128, dtype="bf16", pack="k128")
    new = flashgen.workload("gemm_w4a8", M=256, N=4096, K=4096, G=128, dtype="bf16", pack="lanes")
    loops = {}
    for target in ("sm_90", "sm_80"):
        for wl, v in ((old, "tile"), (new, "tile_lanes")):
            loop = loop_opcodes(flashgen.compile(wl, target, schedule={**s, "variant": v}).binary)
            assert any(op.startswith(("IGMMA", "IMMA")) for op in loop), (target, v, loop)
            loops[target, v] = loop
    assert not any(op.startswith("STS") for op in loops["sm_90", "tile_lanes"])
    assert sum(loops["sm_90", "tile_lanes"].values()) < 2 / 3 * sum(loops["sm_90", "tile"].values())
    unpack = {v: sum(n for op, n in loops["sm_90", v].items() if op.startswith(("PRMT", "LOP3"))) for v in ("tile", "tile_lanes")}
    assert unpack["tile_lanes"] * 4 < unpack["tile"], unpack
    # group scales multiplied into the lanes: no group epilogue between the instructions (its shift
    # and multiply per accumulator element: 64 SHF.R.S32.HI and 64 IMAD at this commit), 296 -> 171
    scaled = loop_opcodes(flashgen.compile(new, "sm_90", schedule={**s, "variant": "tile_lanes_scaled"}).binary)
    assert any(op.startswith("IGMMA") for op in scaled) and not any(op.startswith("STS") for op in scaled), scaled
    assert scaled.get("SHF.R.S32.HI", 0) == 0 < loops["sm_90", "tile_lanes"]["SHF.R.S32.HI"], scaled
    assert sum(scaled.values()) < 0.7 * sum(loops["sm_90", "tile_lanes"].values()), scaled
    # each word's nibble signs flipped once (one XOR for eight codes), not per four codes after their
    # mask: per four codes a mask and the byte-sign XOR, 2.5 LOP3 with the word's (48 -> 40 at this commit)
    words = s["block_n"] * s["block_k"] // 8 // (32 * s["num_warps"])
    assert scaled["LOP3.LUT"] <= 2.5 * 2 * words, scaled
    amd = flashgen.compile(new, "gfx942", schedule={**s, "variant": "tile_lanes", "num_stages": 2})
    assert "v_mfma" in amd.asm["amdgcn"] and amd.binary


def test_k_beyond_exact_int32_sums_is_refused():
    """K products of |x| <= 128 and |w8| <= 128 stay exact in int32 up to K = 131071 (either layout)."""
    for pack in ("k128", "lanes"):
        flashgen.workload("gemm_w4a8", M=1, N=16, K=131071, G=131071, group="channel", pack=pack)
        with pytest.raises(FlashgenError, match="int32 sums"):
            flashgen.workload("gemm_w4a8", M=1, N=16, K=131072, G=128, pack=pack)


def test_forms_from_records_compares_each_form_best_and_the_same_tile(tmp_path, monkeypatch):
    """benchmarks/studies/forms_from_records.py: per workload each form's fastest ok record, the ratio
    over the first form's, and with --same-tile the tiles both forms measured; failed records and other
    ops are left out, a workload without both forms has no row."""
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    import forms_from_records

    tile = {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 4}

    def rec(m, form, us, status="ok", op="gemm_w4a8", **knobs):
        return {"workload": {"op": op, "dims": {"M": m, "N": 64, "K": 128, "G": 128}, "attrs": {"pack": "lanes"}},
                "target_key": "cuda:sm_90/h100", "device": "H100", "status": status, "latency_us": us,
                "schedule": {**tile, **knobs, "variant": form}}
    recs = [rec(256, "tile_lanes", 30.0), rec(256, "tile_lanes", 20.0, block_n=64), rec(256, "tile_lanes_scaled", 24.0),
            rec(256, "tile_lanes_scaled", 1.0, status="crash"), rec(256, "tile_lanes_scaled", 5.0, op="gemm_w8a8"),
            rec(16, "tile_lanes", 9.0)]  # M = 16: one form only
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setattr(sys, "argv", ["forms_from_records.py", str(src), "--op", "gemm_w4a8", "--forms",
                                      "tile_lanes,tile_lanes_scaled", "--same-tile", "--out-dir", str(tmp_path)])
    forms_from_records.main()
    rows = json.loads((tmp_path / "forms_from_records.json").read_text())["rows"]
    assert [r[:5] for r in rows] == [["G=128 K=128 M=256 N=64", "best of each", 20.0, 24.0, 20.0 / 24.0],
                                     ["G=128 K=128 M=256 N=64", json.dumps(tile, sort_keys=True), 30.0, 24.0, 30.0 / 24.0]]
