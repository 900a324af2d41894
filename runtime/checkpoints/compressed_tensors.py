"""compressed-tensors checkpoints (`quant_method: compressed-tensors`): the config's one scheme read,
checked, and mapped to the decoder mode that computes it as the checkpoint defines it; any other
scheme is refused, naming the key.

The format, as its project documents it: `config_groups` maps names to schemes, each with `targets`
(the modules it applies to: "Linear" for every linear), `weights` and `input_activations` (the
quantization of each: `num_bits`, `type` int | float, `symmetric`, `strategy` tensor | channel |
group | block | token, `group_size`, `dynamic`, `actorder`); `ignore` lists the modules kept in float
(names, or regular expressions after `re:`); `format` (at the top, or per scheme) says how weights are
stored, for a linear of N outputs over K inputs (w = value * scale, symmetric schemes):
- int-quantized: `weight` int8 [N, K], `weight_scale` [N, 1] (channel) or [1] (tensor);
- float-quantized: `weight` float8_e4m3fn [N, K], `weight_scale` as above;
- pack-quantized: `weight_packed` int32 [N, K * bits / 32], each word holding 32 / bits consecutive
  k of one row, the lowest bits first, each value stored plus 2^(bits - 1); `weight_scale` [N, K / G]
  (group) or [N, 1] (channel); `weight_shape` [2], the unpacked [N, K]; with `actorder: group`,
  `weight_g_idx` int32 [K], the group of each k.

Modes: int8 weights (channel or tensor) with dynamic per-token int8 activations run as w8a8, without
activation quantization as w8a16; e4m3 weights with dynamic per-token e4m3 activations as fp8; packed
4-bit weights as w4a16 (groups or channel, act-order included), with dynamic per-token int8
activations as w4a8 (per channel only: gemm_w4a8's group scales are integers); packed 8-bit weights
per channel as w8a16. Refused, as the decoder would compute another model: static activation scales,
asymmetric weights, block scales, weight-only e4m3, several schemes, a KV-cache scheme, sparsity,
transforms, an `ignore` that keeps one of the decoder's linears in float or that does not keep the
lm_head.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.int_weight import IntWeight, act_order, check_stored, unpack_cols
from flashgen.runtime.decoder.quant_modes import (Fp8Linear, QuantLinear, W4A8Linear, W4A16Linear, W8A8Linear, W8A16Linear,
                                          cpu_weight)

FORMATS = ("int-quantized", "float-quantized", "pack-quantized")
FLOATS = ("F32", "F16", "BF16")
UNSUPPORTED = ("sparsity_config", "kv_cache_scheme", "transform_config")  # keys that must be absent or empty
GROUP_ORDERS = ("group", "dynamic")  # actorder values whose checkpoints store weight_g_idx
IN_ORDER = (None, False, "weight", "static")  # actorder values whose weights are stored in k order


@dataclass(frozen=True)
class CompressedConfig:
    format: str              # one of FORMATS
    bits: int                # 8, or 4 (pack-quantized)
    strategy: str            # tensor | channel | group
    group: int               # k per scale (group strategy); -1: one group over all of K
    activations: str | None  # dynamic per-token activations: int8 | fp8e4m3; None: weight-only
    act_order: bool          # weight_g_idx gives each k's group
    ignore: tuple[str, ...] = ()  # the modules kept in float (`ignored`)
    method = "compressed-tensors"

    def group_of(self, k: int) -> int:
        return k if self.group == -1 else self.group

    @property
    def mode(self) -> type[QuantLinear]:
        """The decoder mode that computes this scheme (module docstring)."""
        if self.format == "float-quantized":
            return Fp8Linear
        if self.format == "int-quantized" or self.bits == 8:
            return W8A8Linear if self.activations else W8A16Linear
        return W4A8Linear if self.activations else W4A16Linear


def _fail(path: Path, key: str, why: str) -> FlashgenError:
    return FlashgenError(f"{path}: quantization_config.{key} {why}")


def _args(scheme: dict, key: str, path: Path) -> dict | None:
    args = scheme.get(key)
    if args is not None and not isinstance(args, dict):
        raise _fail(path, key, f"must be an object or null, got {args!r}")
    return args


def _weights(fmt: str, w: dict, where: str, path: Path) -> tuple[int, str, int, bool]:
    """bits, strategy, group size and act-order of the weights' args, checked against the format."""
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    want_kind = "float" if fmt == "float-quantized" else "int"
    if kind != want_kind:
        raise _fail(path, f"{where}.type", f"is {kind!r}: {fmt} weights are {want_kind}")
    if bits not in ((4, 8) if fmt == "pack-quantized" else (8,)):
        raise _fail(path, f"{where}.num_bits", f"is {bits!r}: {fmt} weights load with "
                                               f"{'4 or 8 bits' if fmt == 'pack-quantized' else '8 bits'}")
    strategies = ("group", "channel") if fmt == "pack-quantized" and bits == 4 else ("channel",) \
        if fmt == "pack-quantized" else ("channel", "tensor")
    if strategy not in strategies:
        raise _fail(path, f"{where}.strategy", f"is {strategy!r}: {bits}-bit {fmt} weights load with "
                                               f"{' or '.join(strategies)} scales")
    if w.get("symmetric", True) is not True:
        raise _fail(path, f"{where}.symmetric", "is not true: asymmetric weights (zero points) are not loaded")
    if w.get("dynamic", False) is not False:
        raise _fail(path, f"{where}.dynamic", f"is {w.get('dynamic')!r}: weights load with static scales only")
    group = -1
    if strategy == "group":
        group = w.get("group_size")
        if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= 1 << 20:
            raise _fail(path, f"{where}.group_size", f"must be a positive integer, got {group!r}")
    order = w.get("actorder")
    if order not in IN_ORDER + GROUP_ORDERS:
        raise _fail(path, f"{where}.actorder", f"is {order!r}: one of group, weight or null loads")
    return bits, strategy, group, strategy == "group" and order in GROUP_ORDERS


def _activations(a: dict | None, fmt: str, strategy: str, where: str, path: Path) -> str | None:
    """The per-token dtype activations are quantized to (None: weight-only), checked against the format."""
    if a is None:
        if fmt == "float-quantized":
            raise _fail(path, where, "is null: e4m3 weights load with dynamic per-token e4m3 activations only "
                                     "(flashgen's gemm_fp8 multiplies two e4m3 operands)")
        return None
    if a.get("dynamic") is not True:
        raise _fail(path, f"{where}.dynamic", f"is {a.get('dynamic')!r}: static activation scales (input_scale) "
                                              "are not loaded; the decoder quantizes activations per token")
    if a.get("strategy") != "token":
        raise _fail(path, f"{where}.strategy", f"is {a.get('strategy')!r}: activations load quantized per token only")
    if a.get("symmetric", True) is not True:
        raise _fail(path, f"{where}.symmetric", "is not true: activations are quantized symmetrically")
    kind = "float" if fmt == "float-quantized" else "int"
    if a.get("type", "int") != kind or a.get("num_bits") != 8:
        raise _fail(path, where, f"is {a.get('num_bits')!r}-bit {a.get('type', 'int')!r}: {fmt} weights load "
                                 f"with 8-bit {kind} activations")
    if fmt == "pack-quantized" and strategy != "channel":
        raise _fail(path, where, "quantizes activations of group-scaled 4-bit weights: gemm_w4a8 takes integer "
                                 "group scales, which this format does not store; per-channel weights load")
    return "fp8e4m3" if kind == "float" else "int8"


def parse_config(qc: dict, path: Path) -> CompressedConfig:
    """A compressed-tensors `quantization_config` checked (module docstring); a scheme the decoder
    would compute otherwise is refused, naming the key."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _fail(path, "quantization_status", f"is {status!r}: the decoder loads compressed checkpoints")
    for key in UNSUPPORTED:
        if qc.get(key) not in (None, {}):
            raise _fail(path, key, "is set: the decoder loads quantized linears only, without it")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _fail(path, "config_groups", f"has {len(groups) if isinstance(groups, dict) else repr(groups)} "
                                           "schemes: the decoder loads one scheme for every linear")
    (name, scheme), = groups.items()
    where = f"config_groups.{name}"
    if not isinstance(scheme, dict):
        raise _fail(path, where, f"must be an object, got {scheme!r}")
    if scheme.get("targets") != ["Linear"]:
        raise _fail(path, f"{where}.targets", f"is {scheme.get('targets')!r}: the decoder loads schemes "
                                              "that target every Linear")
    if _args(scheme, "output_activations", path) is not None:
        raise _fail(path, f"{where}.output_activations", "is set: output quantization is not loaded")
    fmt = scheme.get("format") or qc.get("format")
    if fmt not in FORMATS:
        raise _fail(path, "format", f"is {fmt!r}: the decoder loads the {', '.join(FORMATS)} formats")
    w = _args(scheme, "weights", path)
    if w is None:
        raise _fail(path, f"{where}.weights", "is missing: a scheme without quantized weights")
    bits, strategy, group, ordered = _weights(fmt, w, f"{where}.weights", path)
    acts = _activations(_args(scheme, "input_activations", path), fmt, strategy, f"{where}.input_activations", path)
    ignore = qc.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise _fail(path, "ignore", f"must be a list of module names, got {ignore!r}")
    if not ignored("lm_head", ignore):
        raise _fail(path, "ignore", "does not keep lm_head in float: the decoder's head is not quantized")
    return CompressedConfig(fmt, bits, strategy, group, acts, ordered, tuple(ignore))


def ignored(module: str, ignore: list[str] | tuple[str, ...]) -> bool:
    """Whether `ignore` keeps `module` in float: a name equal to it (or to its last parts), or a
    `re:` expression matching it from its start."""
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif module == entry or module.endswith("." + entry):
            return True
    return False


def stored_tensors(cfg: CompressedConfig, n: int, k: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """A linear's stored tensors (name suffix -> shape and safetensors dtypes) of N outputs over K inputs."""
    scale = (n, 1) if cfg.strategy == "channel" else (1,) if cfg.strategy == "tensor" else (n, k // cfg.group_of(k))
    if cfg.format != "pack-quantized":
        return {"weight": ((n, k), ("F8_E4M3",) if cfg.format == "float-quantized" else ("I8",)),
                "weight_scale": (scale, FLOATS)}
    out = {"weight_packed": ((n, k * cfg.bits // 32), ("I32",)), "weight_scale": (scale, FLOATS),
           "weight_shape": ((2,), ("I64", "I32"))}
    if cfg.act_order:
        out["weight_g_idx"] = ((k,), ("I32",))
    return out


@dataclass
class ScaledWeight:
    """An int8 or e4m3 weight [N, K] as stored, and its fp32 scale per output channel [N]."""
    values: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scales[:, None]


def read_linear(tensors: Mapping[str, torch.Tensor], prefix: str, cfg: CompressedConfig, n: int, k: int,
                source: str) -> IntWeight | ScaledWeight:
    """The linear `prefix` of N outputs over K inputs from its stored tensors; a tensor missing or of a
    shape (or, for weight_shape, values) the config does not imply is refused by name."""
    g = cfg.group_of(k)
    if k % g:
        raise FlashgenError(f"{source}: group size {g} does not divide {prefix}'s {k} inputs")
    if cfg.format == "pack-quantized" and (k * cfg.bits) % 32:
        raise FlashgenError(f"{source}: {prefix} has {k} inputs, which {32 // cfg.bits}-value words do not pack")
    check_stored(tensors, prefix, {x: shape for x, (shape, _) in stored_tensors(cfg, n, k).items()}, source)
    scale = tensors[prefix + "weight_scale"].float()
    if cfg.format != "pack-quantized":
        return ScaledWeight(tensors[prefix + "weight"], scale.reshape(-1).expand(n).contiguous())
    shape = tensors[prefix + "weight_shape"].tolist()
    if shape != [n, k]:
        raise FlashgenError(f"{source}: tensor {prefix}weight_shape is {shape}, the config implies {[n, k]}")
    codes = unpack_cols(tensors[prefix + "weight_packed"], cfg.bits).to(torch.uint8)
    zeros = torch.full((n, k // g), 1 << (cfg.bits - 1), dtype=torch.uint8, device=codes.device)
    perm = act_order(tensors[prefix + "weight_g_idx"], prefix, k, g, source, "weight_g_idx") if cfg.act_order else None
    return IntWeight(codes.contiguous(), scale.contiguous(), zeros, g, perm)


def scaled_linear(parts: list[ScaledWeight], mode: type[W8A8Linear | W8A16Linear | Fp8Linear],
                  dtype: torch.dtype) -> QuantLinear:
    """One decoder linear from int8 (w8a8, w8a16) or e4m3 (fp8) weights stacked along N, kept as stored
    with their per-channel scales (a per-tensor scale broadcast to its rows); the CPU keeps the
    dequantized weight where its mode multiplies it (`cpu_fallback`: the weight-only modes and fp8)."""
    values = torch.cat([p.values for p in parts]).contiguous()
    scales = torch.cat([p.scales for p in parts]).contiguous()
    q = mode((values.shape[0], values.shape[1]), values, scales)
    if values.device.type != "cuda" and mode is not W8A8Linear:
        q.weight = cpu_weight(torch.cat([p.dequantize() for p in parts]).to(dtype))
    return q
