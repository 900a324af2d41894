"""OpenAI request bodies, checked as data: a request to /v1/completions or /v1/chat/completions as a
prompt (text, token ids, or a conversation) and the engine's SamplingParams, or `RequestError` naming
the field (a 400 with OpenAI's error body).

The sampling fields are OpenAI's: max_tokens (max_completion_tokens too for chat), temperature, top_p,
seed, stop (a string or up to 4), and, as vLLM takes them, top_k, min_p, repetition_penalty and
stop_token_ids (stopping besides the model's EOS ids). A field not given takes the model folder's
generation_config.json setting, else `flashgen generate`'s default (runtime/checkpoints/
generation_config.py `sampling_params`), but the seed, drawn at random so that two sampled requests
differ. Their values are checked by the engine's own `check_request` (runtime/decoder/sampling.py),
its message told in OpenAI's names. What the engine cannot honour is refused by name rather than
ignored: n or best_of other than 1, logprobs, echo, suffix, a logit bias, frequency or presence
penalties other than 0 (repetition_penalty is the engine's), tools; so is any field this server does
not know.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Any

from flashgen.errors import FlashgenError
from flashgen.runtime.checkpoints.generation_config import sampling_params
from flashgen.runtime.decoder.sampling import SamplingParams, check_request

MAX_STOP = 4             # stop strings, as OpenAI allows
ENGINE_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "min_p": "min_p", "repetition_penalty": "repetition_penalty", "seed": "seed",
                "stop_tokens": "stop_token_ids", "prompt": "prompt"}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# fields refused unless they hold the value that changes nothing
NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
           "logit_bias": None, "frequency_penalty": 0, "presence_penalty": 0, "tools": None, "tool_choice": None,
           "functions": None, "function_call": None, "parallel_tool_calls": None}
COMMON = {"model", "stream", "stream_options", "max_tokens", "seed", "stop", "stop_token_ids", "user",
          *SAMPLING, *NEUTRAL}
FIELDS = {"completion": COMMON | {"prompt"}, "chat": COMMON | {"messages", "max_completion_tokens"}}
ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(FlashgenError):
    """A malformed request: a 400 (or `status`) with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.code, self.status, self.kind = param, code, status, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Parsed:
    """A request, checked: its prompt (token ids, or `messages` to render) and decoding."""
    prompt: list[int] | str | None
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    cap: int | None          # generation_config.json's max_length where it bounds the new tokens
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    length_field: str        # the field that gave max_new_tokens, for messages about it


def parse(body: Any, kind: str, served_name: str, defaults: dict[str, Any], eos: tuple[int, ...]) -> Parsed:
    """`body` (parsed JSON) of a `kind` ("completion" or "chat") request for the model `served_name`,
    with the folder's generation `defaults` and EOS ids `eos`; RequestError naming the first bad field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise RequestError(f"unrecognized request argument: {unknown[0]}", unknown[0])
    for name, neutral in NEUTRAL.items():
        if body.get(name) not in (None, neutral) and not (neutral is None and body[name] in ([], {})):
            raise RequestError(f"{name}={body[name]!r:.40} is not supported by this server"
                               + (" (use repetition_penalty)" if name.endswith("_penalty") else ""), name,
                               "unsupported_parameter")
    if body.get("model") != served_name:
        raise RequestError(f"the model {body.get('model')!r:.60} does not exist; this server serves {served_name!r}",
                           "model", "model_not_found")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise RequestError("stream_options must be an object with at most include_usage", "stream_options")
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")
    length_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if kind == "chat" and body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise RequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    given = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    seed = body["seed"] if body.get("seed") is not None else secrets.randbits(63)
    params, cap = sampling_params(defaults, given, body.get(length_field), seed)
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        params = replace(params, stop_tokens=(*eos, *ids) if isinstance(ids, list) else ids)
    prompt, messages = (_prompt(body), None) if kind == "completion" else (None, _messages(body))
    return Parsed(prompt, messages, params, cap, _stop(body), stream, include_usage, length_field)


def check(prompt: list[int], parsed: Parsed, vocab_size: int) -> None:
    """The engine's checks of the prompt and sampling (`check_request`), in OpenAI's names."""
    try:
        check_request(prompt, parsed.params, vocab_size)
    except FlashgenError as e:
        field, _, rest = str(e).partition(" ")
        name = parsed.length_field if field == "max_new_tokens" else ENGINE_NAMES.get(field)
        raise RequestError(f"{name} {rest}" if name else str(e), name) from None


def _flag(body: dict[str, Any], key: str, name: str | None = None) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name or key} must be true or false, got {value!r:.40}", name or key)
    return bool(value)


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and len(stops) <= MAX_STOP and all(isinstance(s, str) and s for s in stops)):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP}, got {stop!r:.60}", "stop")
    return tuple(stops)


def _prompt(body: dict[str, Any]) -> list[int] | str:
    """A completion's prompt: text, or token ids (ids checked against the vocabulary by `check`)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a batch of one
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return p
    raise RequestError(f"prompt must be non-empty text or token ids, one prompt (n=1), got {p!r:.60}", "prompt")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat's messages: each a role and its text (a string, or a list of text parts, joined)."""
    msgs = body.get("messages")
    if not (isinstance(msgs, list) and msgs):
        raise RequestError("messages must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not (isinstance(m, dict) and m.get("role") in ROLES and set(m) <= {"role", "content", "name"}):
            raise RequestError(f"messages[{i}] must be {{role, content}} with a role of {', '.join(ROLES)}",
                               "messages")
        content = m.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                             isinstance(p.get("text"), str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be text (a string or text parts)", "messages")
        out.append({**m, "content": content})
    return out
