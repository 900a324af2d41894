"""A model folder's generation_config.json read as transformers' `generate` reads it: the defaults of
`flashgen generate`'s decoding, or refused in one line.

Each setting the engine applies (runtime/decoder/engine.py `distribution`) is checked and taken: the temperature
only where do_sample is true (1.0 where it gives none; greedy otherwise, as in transformers), the
repetition penalty, top-k, top-p and min-p as given, top-k 50 where the file (or the folder) has none,
as transformers samples. max_new_tokens is the default length; without it, max_length caps prompt + new
tokens. A setting that changes which
tokens come out and that the engine does not compute (beam search, n-gram bans, forced or suppressed
tokens, minimum lengths...) is refused naming it: a folder never decodes other than its file says.
Settings that leave the tokens alone (caching, pad ids, return options) are not read.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.model_config import json_object

if TYPE_CHECKING:
    from flashgen.runtime.decoder.sampling import SamplingParams

DEFAULT_NEW_TOKENS = 64  # where neither a request nor the folder says (flashgen/cli.py names it for its help)
TRANSFORMERS_TOP_K = 50  # transformers' GenerationConfig default, in force whenever it samples


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


TAKEN: dict[str, tuple[Callable[[Any], bool], str]] = {  # key: (whether a value is valid, what it must be)
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "temperature": (lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    "top_k": (lambda v: _count(v) and v >= 0, "an integer >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "a finite number > 0"),
    "max_new_tokens": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
    "max_length": (lambda v: _count(v) and v >= 1, "an integer >= 1"),
}
REFUSED = {  # key: (its value that changes nothing, what else asks for)
    "num_beams": (1, "beam search"),
    "num_beam_groups": (1, "group beam search"),
    "diversity_penalty": (0.0, "group beam search"),
    "penalty_alpha": (0.0, "contrastive search"),
    "dola_layers": (None, "DoLa decoding"),
    "no_repeat_ngram_size": (0, "an n-gram ban"),
    "encoder_repetition_penalty": (1.0, "an encoder repetition penalty"),
    "typical_p": (1.0, "typical sampling"),
    "epsilon_cutoff": (0.0, "epsilon sampling"),
    "eta_cutoff": (0.0, "eta sampling"),
    "top_h": (None, "top-H sampling"),
    "min_length": (0, "a minimum length"),
    "min_new_tokens": (0, "a minimum length"),
    "bad_words_ids": (None, "banned tokens"),
    "suppress_tokens": (None, "suppressed tokens"),
    "begin_suppress_tokens": (None, "suppressed tokens"),
    "sequence_bias": (None, "token biases"),
    "forced_bos_token_id": (None, "a forced first token"),
    "forced_eos_token_id": (None, "a forced last token"),
    "force_words_ids": (None, "constrained beam search"),
    "constraints": (None, "constrained beam search"),
    "exponential_decay_length_penalty": (None, "a length penalty on EOS"),
    "guidance_scale": (1.0, "classifier-free guidance"),
    "stop_strings": (None, "stop strings"),
    "token_healing": (False, "token healing"),
    "watermarking_config": (None, "watermarking"),
}


def _changes_nothing(value: Any, neutral: Any) -> bool:
    return value is None or value == neutral or (neutral is None and value in ([], {}, ""))


def generation_defaults(folder: str | Path) -> dict[str, Any]:
    """The folder's decoding defaults (module docstring) as SamplingParams fields (runtime/decoder/engine.py),
    plus max_length where the file gives one (a cap, not a field)."""
    path = Path(folder) / "generation_config.json"
    g = json_object(path)
    for key, (neutral, what) in REFUSED.items():
        if not _changes_nothing(g.get(key), neutral):
            raise FlashgenError(f"{path}: {key} is {g[key]!r}, which asks for {what}; flashgen decodes greedily "
                                "or by sampling only (remove the key to decode without it)")
    found = {}
    for key, (valid, must) in TAKEN.items():
        if g.get(key) is not None:
            if not valid(g[key]):
                raise FlashgenError(f"{path}: {key} must be {must}, got {g[key]!r}")
            found[key] = g[key]
    if found.pop("do_sample", False):
        found.setdefault("temperature", 1.0)
    else:
        found.pop("temperature", None)
    found.setdefault("top_k", TRANSFORMERS_TOP_K)
    if found.get("repetition_penalty") == 1.0:
        del found["repetition_penalty"]
    return found


def within_max_length(n: int, max_length: int | None, prompt_len: int, where: Path) -> int:
    """`n` new tokens, fewer where prompt + n would pass the file's max_length (None: no cap); a prompt
    already that long is refused."""
    if max_length is None:
        return n
    if prompt_len >= max_length:
        raise FlashgenError(f"the prompt's {prompt_len} tokens reach {where}'s max_length of {max_length}; "
                            "pass --max-new-tokens to generate past it")
    return min(n, max_length - prompt_len)


def sampling_params(defaults: dict[str, Any], given: dict[str, Any], max_new_tokens: int | None,
                    seed: int) -> tuple[SamplingParams, int | None]:
    """A request's decoding: each setting `given` (a flag of `generate`, a field of a served request),
    else the folder's `defaults` (`generation_defaults`), else SamplingParams'; its length
    `max_new_tokens` where given, else the file's, else DEFAULT_NEW_TOKENS; and the file's
    max_length, the cap on prompt + new tokens where neither gives the length (None: no cap). Values
    are taken as they are: `Engine.add` checks them (runtime/decoder/sampling.py `check_request`)."""
    from flashgen.runtime.decoder.sampling import SamplingParams

    defaults = dict(defaults)
    cap = defaults.pop("max_length", None)
    n = defaults.pop("max_new_tokens", None)
    if max_new_tokens is not None or n is not None:
        cap = None
    n = max_new_tokens if max_new_tokens is not None else n if n is not None else DEFAULT_NEW_TOKENS
    return SamplingParams(max_new_tokens=n, seed=seed, **{**defaults, **given}), cap
