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
from flashgen.quant import W4A8_GROUP_MAX, pack_int4, quantize_rtn, quantize_w4a8
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
