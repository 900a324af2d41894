"""The fastest bare read of a tensor's bytes: a Triton kernel that loads every 32-bit word once and
keeps only an XOR per program, in the grid and tile of a small sweep that times fastest on this GPU.
It is the floor a kernel reading those bytes once stands on in the same conditions (its launch, its
DRAM ramp, its wave of programs): tighter than torch's passes (benchmarks/gemm.py `weight_reads`),
whose reduction and copy kernels are not built to stream.

A chain of them, one launch per kernel of a decode step, each reading what that kernel must read,
replayed from one CUDA graph, is the step's read floor (benchmarks/studies/decode_profile.py --floor).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _xor_words(src_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (BLOCK * STEPS)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(STEPS):  # unrolled: every step's loads in flight before the first XOR
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc = acc ^ tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


@dataclass(frozen=True)
class ReadConfig:
    """Words a program loads per step, unrolled steps per program, warps per program."""
    block: int
    steps: int
    warps: int

    def programs(self, n_words: int) -> int:
        return triton.cdiv(n_words, self.block * self.steps)


CONFIGS = tuple(ReadConfig(b, s, w) for b in (1024, 4096) for s in (1, 4, 8) for w in (4, 8))


def words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as 32-bit words (a tail of 1-3 bytes is left out: no weight has one)."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    return flat[:flat.numel() // 4 * 4].view(torch.int32)


def reader(t: torch.Tensor, cfg: ReadConfig) -> Callable[[], torch.Tensor]:
    """A call that reads `t` once with `cfg`; returns the per-program XORs."""
    src = words(t)
    n = src.numel()
    out = torch.empty(max(cfg.programs(n), 1), dtype=torch.int32, device=t.device)
    grid = (cfg.programs(n),)

    def run() -> torch.Tensor:
        _xor_words[grid](src, out, n, BLOCK=cfg.block, STEPS=cfg.steps, num_warps=cfg.warps)
        return out
    return run


def xor_of(t: torch.Tensor) -> int:
    """The XOR of a tensor's words, computed by torch: what the readers' outputs fold to."""
    w = words(t).to(torch.int64) & 0xFFFFFFFF
    acc = 0
    for bit in range(32):
        acc |= (int(((w >> bit) & 1).sum()) & 1) << bit
    return acc - (1 << 32) if acc >= 1 << 31 else acc


def fastest(t: torch.Tensor, l2_bytes: int, configs: tuple[ReadConfig, ...] = CONFIGS) -> tuple[ReadConfig, float]:
    """The config that reads `t` fastest from memory (each call after an L2 flush), and its time in us."""
    from flashgen.schedules.timing import gpu_time

    timed = [(gpu_time(reader(t, c), t.device, True, l2_bytes).median_us, c) for c in configs]
    us, cfg = min(timed, key=lambda x: x[0])
    return cfg, us
