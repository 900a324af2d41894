"""Pre-quantized GPTQ and AWQ linears: packed here by loops written from the formats' documented
layouts (independent of runtime/checkpoints/prequant.py's unpacking), read back into codes, scales and zero
points, dequantized against the formula; and every malformed config or tensor refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.prequant import AWQ_ORDER, parse_config, read_linear

SRC = Path("ckpt/config.json")


def pack_rows(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] -> int32 [R * bits / 32, C]: word i of a column holds rows per*i .. per*i+per-1, lowest first."""
    per = 32 // bits
    out = torch.zeros(vals.shape[0] // per, vals.shape[1], dtype=torch.int64)
    for i in range(out.shape[0]):
        for j in range(per):
            out[i] |= vals[per * i + j].long() << (bits * j)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def pack_cols(vals: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] -> int32 [R, C * bits / 32]: value j of word i holds column per*i + order[j]."""
    per = 32 // bits
    order = order or tuple(range(per))
    out = torch.zeros(vals.shape[0], vals.shape[1] // per, dtype=torch.int64)
    for i in range(out.shape[1]):
        for j in range(per):
            out[:, i] |= vals[:, per * i + order[j]].long() << (bits * j)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def draw(n: int, k: int, g: int, bits: int, sym: bool, gen: torch.Generator, act_order: bool):
    q = torch.randint(0, 1 << bits, (k, n), generator=gen)                 # [K, N], as the formats store
    z = torch.full((k // g, n), 1 << (bits - 1)) if sym else torch.randint(1, (1 << bits) - 1, (k // g, n), generator=gen)
    s = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).half()
    g_idx = (torch.randperm(k, generator=gen) // g if act_order else torch.arange(k) // g).to(torch.int32)
    want = (q.double() - z.double()[g_idx.long()]) * s.double()[g_idx.long()]  # [K, N]
    return q, z, s, g_idx, want.T


@pytest.mark.parametrize("bits,sym,fmt,act_order,group", [
    (4, True, "gptq", False, 32), (4, False, "gptq", True, 32), (4, False, "gptq_v2", False, -1),
    (8, False, "gptq", True, 16), (8, True, "gptq_v2", False, 64)])
def test_gptq_linears_read_back(bits, sym, fmt, act_order, group):
    n, k = 24, 64
    gen = torch.Generator().manual_seed(bits * 10 + act_order)
    g = k if group == -1 else group
    q, z, s, g_idx, want = draw(n, k, g, bits, sym, gen, act_order)
    stored_z = z - 1 if fmt == "gptq" else z
    t = {"l.qweight": pack_rows(q, bits), "l.qzeros": pack_cols(stored_z, bits), "l.scales": s, "l.g_idx": g_idx}
    cfg = parse_config({"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
                        "checkpoint_format": fmt}, SRC)
    w = read_linear(t, "l.", cfg, n, k, "model.safetensors")
    assert w.codes.shape == (n, k) and w.scales.shape == w.zeros.shape == (n, k // g) and w.group == g
    assert (w.perm is not None) == act_order
    if act_order:  # codes[:, perm]: each run of g inputs one group
        assert bool((g_idx.long()[w.perm] == torch.arange(k) // g).all())
    torch.testing.assert_close(w.dequantize().double(), want, rtol=0, atol=1e-6)


def test_awq_linears_read_back():
    n, k, g = 32, 64, 16
    q, z, s, _, want = draw(n, k, g, 4, False, torch.Generator().manual_seed(3), False)
    t = {"l.qweight": pack_cols(q, 4, AWQ_ORDER), "l.qzeros": pack_cols(z, 4, AWQ_ORDER), "l.scales": s}
    cfg = parse_config({"quant_method": "awq", "bits": 4, "group_size": g, "version": "GEMM", "zero_point": True}, SRC)
    w = read_linear(t, "l.", cfg, n, k, "model.safetensors")
    torch.testing.assert_close(w.dequantize().double(), want, rtol=0, atol=1e-6)
    plain = {**t, "l.qweight": pack_cols(q, 4)}  # the nibbles in plain order: other columns, so other weights
    assert not torch.allclose(read_linear(plain, "l.", cfg, n, k, "m").dequantize().double(), want)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "bitsandbytes"}, r"quantization_config.quant_method is 'bitsandbytes': the decoder loads gptq, awq"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"quantization_config.bits is 3: gptq checkpoints load with 4 or 8 bits"),
    ({"quant_method": "awq", "bits": 8}, r"quantization_config.bits is 8: awq checkpoints load with 4 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, r"quantization_config.group_size must be a positive integer or -1, got 0"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": "no"}, r"quantization_config.sym must be true or false"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, r"checkpoint_format is 'marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"version is 'gemv': AWQ loads in its GEMM packing only"),
    ("gptq", r"quantization_config must be an object")])
def test_bad_configs_are_one_line(qc, match):
    with pytest.raises(FlashgenError, match=match):
        parse_config(qc, SRC)


def test_bad_tensors_are_refused_by_name():
    n, k = 24, 64
    q, z, s, g_idx, _ = draw(n, k, 32, 4, False, torch.Generator().manual_seed(0), True)
    good = {"l.qweight": pack_rows(q, 4), "l.qzeros": pack_cols(z, 4), "l.scales": s, "l.g_idx": g_idx}
    cfg = parse_config({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}, SRC)
    with pytest.raises(FlashgenError, match=r"^m: tensor l.qweight has shape \[8, 12\], the quantization_config implies \[8, 24\]$"):
        read_linear({**good, "l.qweight": good["l.qweight"][:, :12]}, "l.", cfg, n, k, "m")
    with pytest.raises(FlashgenError, match=r"^m: tensor l.qzeros is missing$"):
        read_linear({x: v for x, v in good.items() if x != "l.qzeros"}, "l.", cfg, n, k, "m")
    with pytest.raises(FlashgenError, match=r"tensor l.g_idx does not give each of the 2 groups 32 inputs"):
        read_linear({**good, "l.g_idx": torch.zeros(k, dtype=torch.int32)}, "l.", cfg, n, k, "m")
    with pytest.raises(FlashgenError, match=r"^m: group size 48 does not divide l.'s 64 inputs$"):
        read_linear(good, "l.", parse_config({"quant_method": "gptq", "bits": 4, "group_size": 48}, SRC), n, k, "m")
