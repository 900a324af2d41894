"""A pre-quantized linear's integer codes, read out of a checkpoint's packed tensors into one form that
every format shares (runtime/checkpoints/prequant.py for GPTQ and AWQ, runtime/checkpoints/compressed_tensors.py), from which
flashgen repacks its own layouts once at load."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashgen.errors import FlashgenError


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


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits values of consecutive rows each, lowest bits first -> [R * 32 / bits, C]."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, device=words.device) * bits
    vals = (w[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)  # [R, per, C]
    return vals.reshape(-1, words.shape[1])


def unpack_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] holding 32 / bits values of consecutive columns each -> [R, C * 32 / bits]; value j
    of a word is column `order[j]` of its run (in order when None)."""
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, device=words.device) * bits
    vals = (w[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # [R, C, per]: value j
    if order is not None:
        vals = vals[:, :, torch.tensor([order.index(c) for c in range(per)], device=words.device)]
    return vals.reshape(words.shape[0], -1)


def _int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def pack_rows(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """`unpack_rows`' inverse: [R, C] values of `bits` -> int32 [R * bits / 32, C]."""
    per = 32 // bits
    v = vals.to(torch.int64).reshape(-1, per, vals.shape[1])
    shifts = torch.arange(per, device=vals.device) * bits
    return _int32((v << shifts[None, :, None]).sum(1))


def pack_cols(vals: torch.Tensor, bits: int) -> torch.Tensor:
    """`unpack_cols`' inverse (columns in order): [R, C] values of `bits` -> int32 [R, C * bits / 32]."""
    per = 32 // bits
    v = vals.to(torch.int64).reshape(vals.shape[0], -1, per)
    shifts = torch.arange(per, device=vals.device) * bits
    return _int32((v << shifts[None, None, :]).sum(2))


def shape_fits(got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """A stored shape against the one its format implies; a single scale ([1]) may be stored as a
    scalar or [1, 1] too, as versions of the formats' writers differ."""
    return got == want or (want == (1,) and len(got) <= 2 and all(d == 1 for d in got))


def check_stored(tensors, prefix: str, shapes: dict[str, tuple[int, ...]], source: str) -> None:
    """Each of a linear's stored tensors (name suffix -> shape) present, of the shape its format implies;
    else refused by name."""
    for name, shape in shapes.items():
        if prefix + name not in tensors:
            raise FlashgenError(f"{source}: tensor {prefix}{name} is missing")
        t = tensors[prefix + name]
        if not shape_fits(tuple(t.shape), shape):
            raise FlashgenError(f"{source}: tensor {prefix}{name} has shape {list(t.shape)}, the "
                                f"quantization_config implies {list(shape)}")


def act_order(g_idx: torch.Tensor, prefix: str, k: int, g: int, source: str, name: str = "g_idx") -> torch.Tensor | None:
    """act-order's k permutation into contiguous groups, or None where g_idx is the plain k // G."""
    idx = g_idx.to(torch.int64)
    counts = torch.bincount(idx, minlength=k // g) if idx.numel() and idx.min() >= 0 else None
    if counts is None or counts.numel() != k // g or bool((counts != g).any()):
        raise FlashgenError(f"{source}: tensor {prefix}{name} does not give each of the {k // g} groups {g} inputs")
    if torch.equal(idx, torch.arange(k, device=idx.device) // g):
        return None
    return torch.argsort(idx, stable=True)
