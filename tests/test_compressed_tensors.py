"""compressed-tensors linears: stored here as the format documents them (int8 and e4m3 values with
channel or tensor scales; 4- and 8-bit values packed along K with an offset, group or channel scales,
act-order's weight_g_idx), read back, dequantized against the formula; each scheme mapped to its
decoder mode, and every scheme the decoder would compute otherwise refused, naming the key."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.compressed_tensors import ignored
from flashgen.runtime.checkpoints.prequant import mode_of, parse_config, quant_linear, read_linear
from tests.test_prequant import pack_cols

SRC = Path("ckpt/config.json")
INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
FP8 = {**INT8, "type": "float"}


def scheme(fmt: str, weights: dict, acts: dict | None = None, **top) -> dict:
    """A quantization_config with one scheme over every Linear, the lm_head kept in float."""
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                 "input_activations": acts}}, **top}


def weights(bits: int, strategy: str, kind: str = "int", group: int | None = None, actorder=None) -> dict:
    return {"num_bits": bits, "type": kind, "symmetric": True, "strategy": strategy, "group_size": group,
            "dynamic": False, "actorder": actorder}


@pytest.mark.parametrize("fmt,w,acts,mode", [
    ("int-quantized", weights(8, "channel"), INT8, "w8a8"),
    ("int-quantized", weights(8, "tensor"), None, "w8a16"),
    ("float-quantized", weights(8, "channel", "float"), FP8, "fp8"),
    ("float-quantized", weights(8, "tensor", "float"), FP8, "fp8"),
    ("pack-quantized", weights(4, "group", group=32, actorder="group"), None, "w4a16"),
    ("pack-quantized", weights(4, "channel"), INT8, "w4a8"),
    ("pack-quantized", weights(8, "channel"), None, "w8a16")])
def test_schemes_map_to_modes(fmt, w, acts, mode):
    assert mode_of(parse_config(scheme(fmt, w, acts), SRC)).mode == mode


@pytest.mark.parametrize("strategy,kind", [("channel", "int"), ("tensor", "int"), ("channel", "float"),
                                           ("tensor", "float")])
def test_int8_and_e4m3_linears_read_back(strategy, kind):
    n, k = 24, 64
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    rows = n if strategy == "channel" else 1
    amax = (w.abs().amax(1) if strategy == "channel" else w.abs().amax().reshape(1)).reshape(rows, 1)
    scale = (amax / (127 if kind == "int" else 448)).to(torch.bfloat16)
    if kind == "int":
        values = torch.round(w / scale.double()).clamp(-128, 127).to(torch.int8)
    else:
        values = (w / scale.double()).clamp(-448, 448).to(torch.float8_e4m3fn)
    cfg = parse_config(scheme(f"{kind}-quantized", weights(8, strategy, kind), INT8 if kind == "int" else FP8), SRC)
    got = read_linear({"l.weight": values, "l.weight_scale": scale}, "l.", cfg, n, k, "m")
    want = values.double() * scale.double()
    torch.testing.assert_close(got.dequantize().double(), want, rtol=0, atol=1e-6)
    q = quant_linear([got, got], cfg, torch.float32, "l")  # stacked: the scales broadcast per row
    stored = (q.f8, q.f8_scale) if kind == "float" else (q.w8, q.w8_scale)
    assert stored[0].dtype == values.dtype and stored[1].shape == (2 * n,) and stored[1].dtype == torch.float32
    assert q.weight is None if cfg.mode.mode == "w8a8" else q.weight is not None
    assert (rel := float((torch.cat([want, want]) - (stored[0].double() * stored[1].double()[:, None])).abs().max())) < 1e-6, rel
    with pytest.raises(FlashgenError, match=r"^m: tensor l.weight_scale has shape \[3\], the quantization_config implies"):
        read_linear({"l.weight": values, "l.weight_scale": torch.ones(3)}, "l.", cfg, n, k, "m")


@pytest.mark.parametrize("bits,strategy,group,actorder", [(4, "group", 32, None), (4, "group", 16, "group"),
                                                          (4, "channel", None, None), (8, "channel", None, None)])
def test_packed_linears_read_back(bits, strategy, group, actorder):
    n, k = 24, 64
    gen = torch.Generator().manual_seed(bits + (group or 0))
    g = group or k
    signed = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, k), generator=gen)
    scale = (torch.rand(n, k // g, generator=gen) * 0.02 + 0.001).half()
    g_idx = torch.randperm(k, generator=gen) // g if actorder else torch.arange(k) // g
    want = signed.double() * scale.double()[:, g_idx]
    t = {"l.weight_packed": pack_cols(signed + (1 << (bits - 1)), bits), "l.weight_scale": scale,
         "l.weight_shape": torch.tensor([n, k])}
    if actorder:
        t["l.weight_g_idx"] = g_idx.to(torch.int32)
    cfg = parse_config(scheme("pack-quantized", weights(bits, strategy, group=group, actorder=actorder)), SRC)
    got = read_linear(t, "l.", cfg, n, k, "m")
    assert (got.perm is not None) == bool(actorder)
    torch.testing.assert_close(got.dequantize().double(), want, rtol=0, atol=1e-6)
    q = quant_linear([got], cfg, torch.float32, "l")
    assert getattr(q, "w4_zeros", None) is None  # symmetric: the kernel without zero points (w8a16 has none)
    torch.testing.assert_close(q.weight.to_dense().double() if q.weight.is_mkldnn else q.weight.double(), want,
                               rtol=0, atol=1e-6)
    with pytest.raises(FlashgenError, match=r"^m: tensor l.weight_shape is \[24, 32\], the config implies \[24, 64\]$"):
        read_linear({**t, "l.weight_shape": torch.tensor([n, 32])}, "l.", cfg, n, k, "m")
    with pytest.raises(FlashgenError, match=r"^m: tensor l.weight_packed has shape"):
        read_linear({**t, "l.weight_packed": t["l.weight_packed"][:, 1:]}, "l.", cfg, n, k, "m")
    with pytest.raises(FlashgenError, match=r"^m: tensor l.weight_scale is missing$"):
        read_linear({x: v for x, v in t.items() if x != "l.weight_scale"}, "l.", cfg, n, k, "m")


def test_w4a8_scheme_keeps_the_codes_and_the_channel_scales():
    n, k = 16, 64
    gen = torch.Generator().manual_seed(9)
    signed = torch.randint(-8, 8, (n, k), generator=gen)
    scale = torch.rand(n, 1, generator=gen) * 0.01 + 0.001
    cfg = parse_config(scheme("pack-quantized", weights(4, "channel"), INT8), SRC)
    got = read_linear({"l.weight_packed": pack_cols(signed + 8, 4), "l.weight_scale": scale,
                       "l.weight_shape": torch.tensor([n, k])}, "l.", cfg, n, k, "m")
    q = quant_linear([got], cfg, torch.float32, "l")
    assert torch.equal(q.w4a8_int8, signed.to(torch.int8)) and q.w4a8_group is None
    torch.testing.assert_close(q.w4a8_scale, scale[:, 0])


def _edit(path: str, value):
    """A function setting (or, for ..., deleting) one key of a config, the path dotted."""
    def apply(qc: dict) -> dict:
        qc = copy.deepcopy(qc)
        *parents, last = path.split(".")
        d = qc
        for p in parents:
            d = d[p]
        if value is ...:
            del d[last]
        else:
            d[last] = value
        return qc
    return apply


BASE = scheme("int-quantized", weights(8, "channel"), INT8)
W = "config_groups.group_0.weights"
A = "config_groups.group_0.input_activations"


@pytest.mark.parametrize("edit,match", [
    (_edit("format", "naive-quantized"), r"quantization_config.format is 'naive-quantized': the decoder loads the int-quantized"),
    (_edit("quantization_status", "frozen"), r"quantization_status is 'frozen'"),
    (_edit("kv_cache_scheme", {"num_bits": 8, "type": "float"}), r"quantization_config.kv_cache_scheme is set"),
    (_edit("sparsity_config", {"format": "sparse-24-bitmask"}), r"quantization_config.sparsity_config is set"),
    (_edit("config_groups.group_1", BASE["config_groups"]["group_0"]), r"config_groups has 2 schemes"),
    (_edit("config_groups.group_0.targets", ["re:.*q_proj"]), r"group_0.targets is \['re:.\*q_proj'\]"),
    (_edit(f"{W}.num_bits", 4), r"group_0.weights.num_bits is 4: int-quantized weights load with 8 bits"),
    (_edit(f"{W}.type", "float"), r"group_0.weights.type is 'float': int-quantized weights are int"),
    (_edit(f"{W}.strategy", "group"), r"group_0.weights.strategy is 'group': 8-bit int-quantized weights load with channel or tensor"),
    (_edit(f"{W}.strategy", "block"), r"group_0.weights.strategy is 'block'"),
    (_edit(f"{W}.symmetric", False), r"group_0.weights.symmetric is not true: asymmetric weights"),
    (_edit(f"{A}.dynamic", False), r"input_activations.dynamic is False: static activation scales"),
    (_edit(f"{A}.strategy", "tensor"), r"input_activations.strategy is 'tensor': activations load quantized per token"),
    (_edit(f"{A}.num_bits", 4), r"input_activations is 4-bit 'int'"),
    (_edit("config_groups.group_0.output_activations", INT8), r"output_activations is set"),
    (_edit("ignore", []), r"ignore does not keep lm_head in float"),
    (_edit("ignore", "lm_head"), r"ignore must be a list of module names"),
    (_edit("config_groups", ...), r"config_groups has None schemes"),
])
def test_bad_schemes_are_refused_by_key(edit, match):
    with pytest.raises(FlashgenError, match=match):
        parse_config(edit(BASE), SRC)


@pytest.mark.parametrize("qc,match", [
    (scheme("float-quantized", weights(8, "channel", "float"), None), r"input_activations is null: e4m3 weights"),
    (scheme("pack-quantized", weights(4, "group", group=128), INT8), r"gemm_w4a8 takes integer group scales"),
    (scheme("pack-quantized", weights(8, "group", group=128)), r"8-bit pack-quantized weights load with channel"),
    (scheme("pack-quantized", weights(4, "group", group=0)), r"weights.group_size must be a positive integer, got 0"),
    (scheme("pack-quantized", weights(4, "group", group=32, actorder="random")), r"actorder is 'random'")])
def test_schemes_computed_otherwise_are_refused(qc, match):
    with pytest.raises(FlashgenError, match=match):
        parse_config(qc, SRC)


def test_ignore_entries_match_names_and_expressions():
    assert ignored("lm_head", ["lm_head"]) and ignored("lm_head", ["re:.*lm_head"])
    assert ignored("model.layers.3.mlp.down_proj", ["re:model.layers.3.mlp.*"])
    assert ignored("model.layers.3.mlp.down_proj", ["mlp.down_proj"])
    assert not ignored("model.layers.3.mlp.down_proj", ["lm_head", "re:.*q_proj", "down"])
