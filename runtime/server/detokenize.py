"""A request's output tokens as text, piece by piece as they arrive, each piece whole characters, and cut
at the first stop string.

Decoding a token alone loses what depends on its neighbours (the space a word-piece or metaspace decoder
puts between words; the bytes of one character split over byte-level tokens), and decoding every
output token again at each step costs the square of the length. So each new piece is the text of a few
tokens before the new ones and the new ones, less the text of those few alone; it is held back while it
ends in U+FFFD (a character whose bytes are not all there yet). The pieces joined are the text of the
whole output decoded at once.

Stop strings (OpenAI's `stop`): the text ends before the first one found, which is not part of it; the
last `longest stop - 1` characters are held back until no stop string can begin in them.
"""
from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5  # tokens decoded before the new ones: enough for any decoder's joins
PARTIAL = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix = 0        # self.ids[prefix:read] were decoded to give the text so far
        self.read = 0
        self.text = ""         # decoded so far (whole characters)
        self.sent = 0          # characters of `text` handed out
        self.stopped = False   # a stop string was found: the text ends at `sent`

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def add(self, ids: list[int]) -> str:
        """The text that `ids` (the next output tokens) make final; "" while held back or stopped."""
        if self.stopped:
            return ""
        self.ids += ids
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith(PARTIAL):
            self.text += after[len(before):]
            self.prefix, self.read = max(0, len(self.ids) - CONTEXT_TOKENS), len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of the output (a partial character's U+FFFD included, as a
        whole decode gives it)."""
        if self.stopped:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.text += after[len(before):]
        self.read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        """The text after `sent` up to the first stop string, or, short of one, all of it but what a
        stop string could still begin in (everything when `final`)."""
        start = max(0, self.sent - max((len(s) for s in self.stop), default=1) + 1)
        found = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if found:
            end, self.stopped = min(found), True
        else:
            end = len(self.text) if final else len(self.text) - max((len(s) for s in self.stop), default=1) + 1
        piece = self.text[self.sent:max(end, self.sent)]
        self.sent += len(piece)
        return piece
