"""Pre-quantized checkpoints: a config.json's `quantization_config` (GPTQ, AWQ) read into one form,
integer codes [N, K] with per-group scales and zero points, from which flashgen repacks its own
layouts once at load (flashgen/quant.py's `pack_int4`; gemm_w4a16's `zp=asym` zeros).

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
from flashgen.quant import pack_int4
from flashgen.runtime.linear import QuantLinear, cpu_weight

METHODS = ("gptq", "awq")
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


def parse_config(qc: object, path: Path) -> PrequantConfig:
    """`quantization_config` checked: an unknown method, bits or group size is refused, naming the key."""
    if not isinstance(qc, dict):
        raise FlashgenError(f"{path}: quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method not in METHODS:
        raise _fail(path, "quant_method", f"is {method!r}: the decoder loads {', '.join(METHODS)} checkpoints "
                                          "(or give a float checkpoint and choose --quant)")
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


@dataclass
class IntWeight:
    """A linear's integer codes [N, K] (0 .. 2^bits - 1), and per group of k its scales and zero points
    [N, K / G]; `perm` (act-order) lists the k in group order, so that codes[:, perm] has contiguous
    groups (the linear then reads x[:, perm])."""
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: int
    perm: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The float weight [N, K] in the checkpoint's k order (float32)."""
        groups = torch.arange(self.codes.shape[1], device=self.codes.device) // self.group
        if self.perm is not None:
            groups = torch.empty_like(groups).scatter_(0, self.perm, groups)
        return (self.codes.float() - self.zeros.float()[:, groups]) * self.scales.float()[:, groups]


def _unpack_along_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits values of consecutive rows each, lowest bits first -> [R * 32 / bits, C]."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, device=words.device) * bits
    vals = (w[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)  # [R, per, C]
    return vals.reshape(-1, words.shape[1])


def _unpack_along_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits values of consecutive columns each -> [R, C * 32 / bits]; value j
    of a word is column `order[j]` of its run (in order when None)."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, device=words.device) * bits
    vals = (w[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # [R, C, per]: value j
    if order is not None:
        vals = vals[:, :, torch.tensor([order.index(c) for c in range(per)], device=words.device)]
    return vals.reshape(words.shape[0], -1)


def packed_shapes(cfg: PrequantConfig, n: int, k: int) -> dict[str, tuple[int, ...]]:
    """A linear's packed tensors (name suffix -> shape) of N outputs over K inputs in `cfg`'s format."""
    g, per = cfg.group_of(k), 32 // cfg.bits
    if cfg.method == "gptq":
        return {"qweight": (k // per, n), "qzeros": (k // g, n // per), "scales": (k // g, n), "g_idx": (k,)}
    return {"qweight": (k, n // per), "qzeros": (k // g, n // per), "scales": (k // g, n)}


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...], source: str) -> None:
    if tuple(t.shape) != shape:
        raise FlashgenError(f"{source}: tensor {name} has shape {list(t.shape)}, the quantization_config "
                            f"implies {list(shape)}")


def read_linear(tensors: Mapping[str, torch.Tensor], prefix: str, cfg: PrequantConfig, n: int, k: int,
                source: str) -> IntWeight:
    """The linear `prefix` (e.g. `model.layers.0.mlp.down_proj.`) of N outputs over K inputs, read from
    its packed tensors; a tensor missing or of a shape the config does not imply is refused by name."""
    g = cfg.group_of(k)
    if k % g:
        raise FlashgenError(f"{source}: group size {g} does not divide {prefix}'s {k} inputs")
    per = 32 // cfg.bits
    if n % per or (cfg.method == "gptq" and k % per):
        raise FlashgenError(f"{source}: {prefix} has {n} outputs and {k} inputs, which {per}-value words do not pack")
    for name, shape in packed_shapes(cfg, n, k).items():
        if prefix + name not in tensors:
            raise FlashgenError(f"{source}: tensor {prefix}{name} is missing")
        _expect(prefix + name, tensors[prefix + name], shape, source)
    qweight, qzeros, scales = (tensors[prefix + x] for x in ("qweight", "qzeros", "scales"))
    if cfg.method == "gptq":
        codes = _unpack_along_rows(qweight, cfg.bits).T
        zeros = _unpack_along_cols(qzeros, cfg.bits).T + (1 if cfg.zeros_less_one else 0)
        perm = _act_order(tensors[prefix + "g_idx"], prefix, k, g, source)
    else:
        codes = _unpack_along_cols(qweight, 4, AWQ_ORDER).T
        zeros = _unpack_along_cols(qzeros, 4, AWQ_ORDER).T
        perm = None
    return IntWeight(codes.to(torch.uint8).contiguous(), scales.T.contiguous(), zeros.to(torch.uint8).contiguous(),
                     g, perm)


def _act_order(g_idx: torch.Tensor, prefix: str, k: int, g: int, source: str) -> torch.Tensor | None:
    """act-order's k permutation into contiguous groups, or None where g_idx is the plain k // G."""
    idx = g_idx.to(torch.int64)
    counts = torch.bincount(idx, minlength=k // g) if idx.numel() and idx.min() >= 0 else None
    if counts is None or counts.numel() != k // g or bool((counts != g).any()):
        raise FlashgenError(f"{source}: tensor {prefix}g_idx does not give each of the {k // g} groups {g} inputs")
    if torch.equal(idx, torch.arange(k, device=idx.device) // g):
        return None
    return torch.argsort(idx, stable=True)


def mode_of(cfg: PrequantConfig) -> str:
    """The decoder's linear mode for a pre-quantized checkpoint: int4 codes run as w4a16 (zero points
    and act-order included); 8-bit GPTQ only as w8a16, whose int8 GEMM takes per-channel symmetric
    weights (model_config refuses other 8-bit checkpoints)."""
    return "w4a16" if cfg.bits == 4 else "w8a16"


def quant_linear(parts: list[IntWeight], cfg: PrequantConfig, dtype: torch.dtype, name: str) -> QuantLinear:
    """One decoder linear (q|k|v, gate|up or alone) from the checkpoint's linears stacked along N, in
    flashgen's layouts: int4 codes repacked (`pack_int4`, in act-order's group order), scales in the
    decoder's dtype, zero points as int8; 8-bit codes less 128 as int8 with per-channel scales. Stacked
    linears must share the act-order permutation (they read the same x)."""
    perms = [p.perm for p in parts]
    if any((a is None) != (perms[0] is None) or (a is not None and not torch.equal(a, perms[0])) for a in perms):
        raise FlashgenError(f"{name}: the linears stacked here have different act-order permutations (g_idx); "
                            "the decoder multiplies them as one")
    codes = torch.cat([p.codes for p in parts])
    scales = torch.cat([p.scales for p in parts])
    zeros = torch.cat([p.zeros for p in parts])
    n, k = codes.shape
    q = QuantLinear((n, k), None, group=parts[0].group, perm=perms[0])
    if cfg.bits == 8:
        if bool((zeros != 128).any()):
            raise FlashgenError(f"{name}: 8-bit zero points other than 128: w8a16 takes symmetric weights only")
        q.w8, q.w8_scale = (codes.to(torch.int16) - 128).to(torch.int8), scales[:, 0].float().contiguous()
    else:
        ordered = codes if perms[0] is None else codes[:, perms[0]]
        q.w4, q.w4_scales, q.w4_zeros = pack_int4(ordered), scales.to(dtype), zeros.to(torch.int8)
    if codes.device.type != "cuda":  # the CPU multiplies the dequantized weight, in the checkpoint's k order
        q.weight = cpu_weight(torch.cat([p.dequantize() for p in parts]).to(dtype))
    return q
