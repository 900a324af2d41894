"""Pre-quantized checkpoints: a config.json's `quantization_config` (GPTQ, AWQ, compressed-tensors)
read into one form, integer codes [N, K] with per-group scales and zero points (runtime/checkpoints/int_weight.py),
from which flashgen repacks its own layouts once at load (flashgen/quant.py's `pack_int4`; gemm_w4a16's
`zp=asym` zeros), or int8 / e4m3 values with per-channel scales (compressed-tensors' int- and
float-quantized formats, runtime/checkpoints/compressed_tensors.py). This module is the one entry point: each
function below dispatches on the config's kind.

The formats, as their projects document them (a linear of N outputs over K inputs, groups of G
along K; w[n, k] = (q[n, k] - z[n, g]) * s[n, g] with g the group of k):
- GPTQ (`quant_method: gptq`): `qweight` int32 [K * bits / 32, N], each word holding 32 / bits
  consecutive k of one column, the lowest bits first; `qzeros` int32 [K / G, N * bits / 32], packed
  the same way along N; `scales` fp16 [K / G, N]; `g_idx` int32 [K], the group of each k (k // G,
  or a permuted order with `desc_act`: act-order; read either way). The original format (`checkpoint_format: gptq`)
  stores each zero point less one; `gptq_v2` stores it as it is. With `sym: true` the stored zero
  points are all 2^(bits - 1); they are read as stored either way.
- AWQ (`quant_method: awq`, `version: gemm`): `qweight` int32 [K, N / 8], each word holding 8
  columns of one k in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble j holds column AWQ_ORDER[j]);
  `qzeros` int32 [K / G, N / 8] packed the same way; `scales` fp16 [K / G, N]; 4 bits only.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from flashgen.errors import FlashgenError
from flashgen.quant import W4A8Weight, pack_int4
from flashgen.runtime.checkpoints import compressed_tensors as ct
from flashgen.runtime.checkpoints.compressed_tensors import CompressedConfig
from flashgen.runtime.checkpoints.int_weight import IntWeight, act_order, check_stored, unpack_cols, unpack_rows
from flashgen.runtime.decoder.quant_modes import QuantLinear, W4A8Linear, W4A16Linear, W8A16Linear, cpu_weight

METHODS = ("gptq", "awq", "compressed-tensors")
# The linears a pre-quantized checkpoint stores quantized (the embeddings, norms and head stay float)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ word holds


@dataclass(frozen=True)
class PrequantConfig:
    method: str        # gptq | awq
    bits: int          # 4, or 8 (GPTQ)
    group: int         # k per scale; -1: one group over all of K
    sym: bool          # GPTQ: every zero point 2^(bits - 1) (as its qzeros say)
    zeros_less_one: bool  # GPTQ's original format stores each zero point less one

    def group_of(self, k: int) -> int:
        return k if self.group == -1 else self.group


def _fail(path: Path, key: str, why: str) -> FlashgenError:
    return FlashgenError(f"{path}: quantization_config.{key} {why}")


def parse_config(qc: object, path: Path) -> "PrequantConfig | CompressedConfig":
    """`quantization_config` checked: an unknown method, bits or group size is refused, naming the key."""
    if not isinstance(qc, dict):
        raise FlashgenError(f"{path}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in METHODS:
        raise _fail(path, "quant_method", f"is {method!r}: the decoder loads {', '.join(METHODS)} checkpoints "
                                          "(or give a float checkpoint and choose --quant)")
    if method == "compressed-tensors":
        return ct.parse_config(qc, path)
    bits_key = "bits" if method == "gptq" else ("bits" if "bits" in qc else "w_bit")
    bits = qc.get(bits_key)
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        raise _fail(path, bits_key, f"is {bits!r}: {method} checkpoints load with "
                                    f"{'4 or 8 bits' if method == 'gptq' else '4 bits'}")
    group_key = "group_size" if "group_size" in qc or method == "gptq" else "q_group_size"
    group = qc.get(group_key, 128 if method == "awq" else None)
    if isinstance(group, bool) or not isinstance(group, int) or not (group == -1 or 1 <= group <= 1 << 20):
        raise _fail(path, group_key, f"must be a positive integer or -1, got {group!r}")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise _fail(path, "version", f"is {qc.get('version')!r}: AWQ loads in its GEMM packing only")
        if qc.get("zero_point", True) is not True:
            raise _fail(path, "zero_point", f"is {qc.get('zero_point')!r}: AWQ loads with zero points only")
        return PrequantConfig("awq", 4, group, False, False)
    sym, desc = qc.get("sym", True), qc.get("desc_act", False)
    for key, value in (("sym", sym), ("desc_act", desc)):
        if not isinstance(value, bool):
            raise _fail(path, key, f"must be true or false, got {value!r}")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail(path, "checkpoint_format", f"is {fmt!r}: GPTQ loads the gptq and gptq_v2 formats")
    return PrequantConfig("gptq", bits, group, sym, fmt == "gptq")


def quantized_tensor(name: str) -> bool:
    """Whether a checkpoint tensor (`model.layers.3.mlp.down_proj.qweight`) is one of a quantized linear's."""
    parts = name.rsplit(".", 1)[0].split(".", 3)
    return len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in LINEARS


# name suffix -> (shape, the safetensors dtypes it may be stored in)
Stored = dict[str, tuple[tuple[int, ...], tuple[str, ...]]]
FLOATS = ("F32", "F16", "BF16")


def stored_tensors(cfg: "PrequantConfig | CompressedConfig", n: int, k: int) -> Stored:
    """A linear's stored tensors (name suffix -> shape and dtypes) of N outputs over K inputs in `cfg`'s format."""
    if isinstance(cfg, CompressedConfig):
        return ct.stored_tensors(cfg, n, k)
    g, per = cfg.group_of(k), 32 // cfg.bits
    if cfg.method == "gptq":
        return {"qweight": ((k // per, n), ("I32",)), "qzeros": ((k // g, n // per), ("I32",)),
                "scales": ((k // g, n), FLOATS), "g_idx": ((k,), ("I32",))}
    return {"qweight": ((k, n // per), ("I32",)), "qzeros": ((k // g, n // per), ("I32",)), "scales": ((k // g, n), FLOATS)}


def read_linear(tensors: Mapping[str, torch.Tensor], prefix: str, cfg: "PrequantConfig | CompressedConfig", n: int,
                k: int, source: str) -> "IntWeight | ct.ScaledWeight":
    """The linear `prefix` (e.g. `model.layers.0.mlp.down_proj.`) of N outputs over K inputs, read from
    its stored tensors; a tensor missing or of a shape the config does not imply is refused by name."""
    if isinstance(cfg, CompressedConfig):
        return ct.read_linear(tensors, prefix, cfg, n, k, source)
    g = cfg.group_of(k)
    if k % g:
        raise FlashgenError(f"{source}: group size {g} does not divide {prefix}'s {k} inputs")
    per = 32 // cfg.bits
    if n % per or (cfg.method == "gptq" and k % per):
        raise FlashgenError(f"{source}: {prefix} has {n} outputs and {k} inputs, which {per}-value words do not pack")
    check_stored(tensors, prefix, {x: shape for x, (shape, _) in stored_tensors(cfg, n, k).items()}, source)
    qweight, qzeros, scales = (tensors[prefix + x] for x in ("qweight", "qzeros", "scales"))
    if cfg.method == "gptq":
        codes = unpack_rows(qweight, cfg.bits).T
        zeros = unpack_cols(qzeros, cfg.bits).T + (1 if cfg.zeros_less_one else 0)
        perm = act_order(tensors[prefix + "g_idx"], prefix, k, g, source)
    else:
        codes = unpack_cols(qweight, 4, AWQ_ORDER).T
        zeros = unpack_cols(qzeros, 4, AWQ_ORDER).T
        perm = None
    return IntWeight(codes.to(torch.uint8).contiguous(), scales.T.contiguous(), zeros.to(torch.uint8).contiguous(),
                     g, perm)


def mode_of(cfg: "PrequantConfig | CompressedConfig") -> type[QuantLinear]:
    """The decoder's linear mode for a pre-quantized checkpoint: GPTQ's and AWQ's int4 codes run as
    w4a16 (zero points and act-order included); 8-bit GPTQ only as w8a16, whose int8 GEMM takes
    per-channel symmetric weights (model_config refuses other 8-bit checkpoints); compressed-tensors as
    its scheme says (runtime/checkpoints/compressed_tensors.py)."""
    if isinstance(cfg, CompressedConfig):
        return cfg.mode
    return W4A16Linear if cfg.bits == 4 else W8A16Linear


def quant_linear(parts: list, cfg: "PrequantConfig | CompressedConfig", dtype: torch.dtype, name: str) -> QuantLinear:
    """One decoder linear (q|k|v, gate|up or alone) from the checkpoint's linears stacked along N, in
    flashgen's layouts: int4 codes repacked (`pack_int4`, in act-order's group order), scales in the
    decoder's dtype, zero points as int8 (w4a16), or with fp32 per-channel scales and no zero points
    (w4a8: the codes' zero points are 8); 8-bit codes less 128 as int8 with per-channel scales. Stacked
    linears must share the act-order permutation (they read the same x). compressed-tensors' int8 and
    e4m3 values as they are (`compressed_tensors.scaled_linear`)."""
    if isinstance(parts[0], ct.ScaledWeight):
        return ct.scaled_linear(parts, mode_of(cfg), dtype)
    perms = [p.perm for p in parts]
    if any((a is None) != (perms[0] is None) or (a is not None and not torch.equal(a, perms[0])) for a in perms):
        raise FlashgenError(f"{name}: the linears stacked here have different act-order permutations (g_idx); "
                            "the decoder multiplies them as one")
    codes = torch.cat([p.codes for p in parts])
    scales = torch.cat([p.scales for p in parts])
    zeros = torch.cat([p.zeros for p in parts])
    n, k = codes.shape
    cpu = codes.device.type != "cuda"
    # (the CPU multiplies the weight-only modes' dequantized weight, in the checkpoint's k order)
    dequantized = cpu_weight(torch.cat([p.dequantize() for p in parts]).to(dtype)) if cpu else None
    mode = mode_of(cfg)
    if cfg.bits == 8:
        if bool((zeros != 128).any()):
            raise FlashgenError(f"{name}: 8-bit zero points other than 128: {mode.mode} takes symmetric weights only")
        return mode((n, k), (codes.to(torch.int16) - 128).to(torch.int8), scales[:, 0].float().contiguous(),
                    weight=dequantized if mode.activations is None else None)
    if mode is W4A8Linear:  # (per channel, symmetric: compressed_tensors.parse_config)
        return W4A8Linear.of_codes(W4A8Weight(codes, scales[:, 0].float().contiguous(), None, parts[0].group))
    ordered = codes if perms[0] is None else codes[:, perms[0]]
    zp = zeros.to(torch.int8) if bool((zeros != 8).any()) else None  # (all 8: the symmetric kernel, no zero points)
    return W4A16Linear((n, k), pack_int4(ordered), scales.to(dtype), parts[0].group, zp, perms[0], weight=dequantized)
