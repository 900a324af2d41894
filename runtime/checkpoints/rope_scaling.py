"""RoPE frequencies of a model config's rope type, computed as transformers computes them: default,
linear (positions divided by the factor), dynamic NTK (the default frequencies within the trained
context, which the decoder never leaves: the engine refuses longer requests), llama3 (per-band
scaling of long wavelengths) and yarn (a ramp between interpolated and extrapolated frequencies, and an
attention factor on cos and sin)."""
from __future__ import annotations

import math

import torch

from flashgen.oplib.rope import cos_sin_table
from flashgen.runtime.checkpoints.model_config import ModelConfig


def _llama3(inv: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(c: ModelConfig, dim: int, p: dict) -> tuple[torch.Tensor, float]:
    base, old = c.rope_theta, p["original_max_position_embeddings"]
    factor = p.get("factor") or c.max_position_embeddings / old

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, ms) / mscale(factor, ms_all) if ms and ms_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    interpolated = extrapolated / factor
    keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


def inv_freq(c: ModelConfig) -> tuple[torch.Tensor, float]:
    """Float64 frequencies of the head's rotated pairs, and the factor on cos and sin."""
    dim, p = c.head_dim, dict(c.rope_params)
    inv = 1.0 / c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    if c.rope_type == "linear":
        return inv / p["factor"], 1.0
    if c.rope_type == "llama3":
        return _llama3(inv, p), 1.0
    if c.rope_type == "yarn":
        return _yarn(c, dim, p)
    return inv, 1.0  # default, and dynamic within the trained context


def rope_table(c: ModelConfig, positions: int) -> torch.Tensor:
    """The [positions, head_dim] cos|sin table the rope_cache kernel reads, for the positions a sequence
    can reach (not max_position_embeddings, which a config may set to 10^9)."""
    freqs, scale = inv_freq(c)
    return cos_sin_table(positions, freqs, scale)
