"""What a request asks of sampling, and its next token: its parameters checked at `Engine.add` (one
line naming a malformed field), and the distribution it draws from, processed as transformers' generate
processes logits (repetition penalty, temperature, top-k, top-p, min-p), greedy at temperature 0."""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

import torch

from flashgen.errors import FlashgenError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_tokens: tuple[int, ...] | None = None  # None: the model's EOS ids (config.json, generation_config.json)

    @property
    def plain_greedy(self) -> bool:
        """Whether the token is the argmax of the raw logits, which the step's graph picks itself (no
        logits need reach the host)."""
        return self.temperature <= 0 and self.repetition_penalty == 1.0


def _is_int(x: object) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def check_request(prompt: list[int], p: SamplingParams, vocab_size: int) -> None:
    """Raise FlashgenError naming the first malformed field of a request (module docstring)."""
    if not isinstance(p, SamplingParams):
        raise FlashgenError(f"params must be a SamplingParams, got {p!r}")
    if not (_is_real(p.temperature) and math.isfinite(p.temperature) and p.temperature >= 0):
        raise FlashgenError(f"temperature must be a finite number >= 0, got {p.temperature!r}")
    if not (_is_real(p.top_p) and 0 < p.top_p <= 1):
        raise FlashgenError(f"top_p must be in (0, 1], got {p.top_p!r}")
    if not (_is_int(p.top_k) and p.top_k >= 0):
        raise FlashgenError(f"top_k must be an integer >= 0, got {p.top_k!r}")
    if not (_is_real(p.min_p) and 0 <= p.min_p <= 1):
        raise FlashgenError(f"min_p must be in [0, 1], got {p.min_p!r}")
    if not (_is_real(p.repetition_penalty) and 0 < p.repetition_penalty < math.inf):
        raise FlashgenError(f"repetition_penalty must be a finite number > 0, got {p.repetition_penalty!r}")
    if not (_is_int(p.max_new_tokens) and p.max_new_tokens >= 1):
        raise FlashgenError(f"max_new_tokens must be an integer >= 1, got {p.max_new_tokens!r}")
    if not (_is_int(p.seed) and 0 <= p.seed < 2 ** 63):
        raise FlashgenError(f"seed must be an integer in [0, 2**63), got {p.seed!r}")
    if p.stop_tokens is not None and not (isinstance(p.stop_tokens, (tuple, list)) and all(map(_is_int, p.stop_tokens))):
        raise FlashgenError(f"stop_tokens must be a tuple of integers, got {p.stop_tokens!r}")
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise FlashgenError(f"prompt must be a non-empty list of token ids, got {prompt!r:.80}")
    for i, t in enumerate(prompt):
        if not (_is_int(t) and 0 <= t < vocab_size):
            raise FlashgenError(f"prompt token {t!r:.40} at position {i} is not an id in the vocabulary "
                                f"[0, {vocab_size})")


def distribution(logits: torch.Tensor, p: SamplingParams, seen: list[int]) -> torch.Tensor:
    """The float64 probabilities a request's next token is drawn from, processed in transformers' order:
    the repetition penalty on every token in `seen` (prompt and output; a positive logit divided by it, a
    negative one multiplied), then temperature, top-k, top-p and min-p. At temperature 0 (greedy after a
    penalty) all the mass is on the penalized argmax. The largest logit is subtracted before dividing, in
    float64, so a tiny temperature tends to greedy instead of overflowing to inf - inf = NaN, and any
    top_p > 0 keeps the likeliest token (float32 rounds a temperature or top_p of 1e-300 to 0)."""
    logits = logits.double()
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(seen, device=logits.device).unique()
        hit = logits[ids]
        logits = logits.index_copy(0, ids, torch.where(hit < 0, hit * p.repetition_penalty,
                                                         hit / p.repetition_penalty))
        logits = logits.nan_to_num(nan=math.nan, posinf=torch.finfo(logits.dtype).max)  # (a tiny penalty's
        # overflow: +inf - +inf would be NaN below; at the largest finite value those tokens tie instead)
    if p.temperature <= 0:
        return torch.zeros_like(logits).index_fill(0, logits.argmax().view(1), 1.0)
    logits = (logits - logits.max()) / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    if p.min_p > 0:  # (relative to the likeliest token, which every filter before keeps)
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator, seen: list[int]) -> int:
    """A token drawn from `distribution` (plain greedy rows are picked in the step's graph instead)."""
    probs = distribution(logits, p, seen)
    if p.temperature <= 0:
        return int(probs.argmax())
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))
