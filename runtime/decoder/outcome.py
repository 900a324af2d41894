"""How one generation ended and how fast it went: why it stopped (an EOS token, another stop token, or
max_new_tokens), the tokens it made, the time to its first token and its decode rate. `flashgen
generate` prints it after the text (a line on stderr), or whole as JSON for scripts."""
from __future__ import annotations

from dataclasses import dataclass

from flashgen.runtime.decoder.engine import Request


@dataclass(frozen=True)
class Outcome:
    reason: str  # "eos" (one of the model's EOS ids), "stop" (another stop token) or "length"
    stop_token: int | None  # the token that stopped it, for "eos" and "stop"
    prompt_tokens: int
    token_ids: list[int]  # every new token, the stop token included
    first_token_s: float  # from the request's start to its first token (its prefill)
    total_s: float  # from the request's start to its last token

    @classmethod
    def of(cls, req: Request, eos_ids: tuple[int, ...], first_token_s: float, total_s: float) -> Outcome:
        """The outcome of `req`, finished without error, timed from its start."""
        last = req.output[-1]
        if last in req.params.stop_tokens:
            reason, stop = ("eos" if last in eos_ids else "stop"), last
        else:
            reason, stop = "length", None
        return cls(reason, stop, len(req.prompt), list(req.output), first_token_s, total_s)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first per second after it; None with a single token (no decode step)."""
        span = self.total_s - self.first_token_s
        return (len(self.token_ids) - 1) / span if len(self.token_ids) > 1 and span > 0 else None

    def line(self) -> str:
        why = {"eos": f"eos (token {self.stop_token})", "stop": f"stop token {self.stop_token}",
               "length": "length (max_new_tokens)"}[self.reason]
        rate = self.decode_tokens_per_s
        return (f"stopped at {why} after {len(self.token_ids)} tokens; time to first token {self.first_token_s:.3f} s, "
                + (f"decode {rate:.1f} tokens/s" if rate is not None else "no decode step"))

    def to_json(self, text: str) -> dict:
        return {"text": text, "token_ids": self.token_ids, "stop_reason": self.reason,
                "stop_token_id": self.stop_token, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": len(self.token_ids), "time_to_first_token_s": self.first_token_s,
                "decode_tokens_per_s": self.decode_tokens_per_s, "total_s": self.total_s}
