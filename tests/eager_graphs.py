"""A CPU stand-in for the engine's CUDA graphs, so that chained (pending) decode steps run in CPU tests."""
from __future__ import annotations

import torch

from flashgen.runtime.decoder.decode_graphs import greedy
from flashgen.runtime.decoder.model import Batch, Decoder


class EagerGraphs:
    """What the engine asks of its CUDA graphs (runtime/decoder/decode_graphs.py), run eagerly on the CPU: each step's
    greedy tokens are kept as the next chained step's inputs, as a replay leaves them on the device."""

    def __init__(self, model: Decoder, cache):
        self.model, self.cache = model, cache
        self.last: tuple[list[int], torch.Tensor] | None = None
        self.picked: torch.Tensor | None = None  # the last step's greedy tokens, NON_FINITE marks kept
        self.chained = 0
        self.rows: dict[int, int] = {}  # decode rows computed per sequence

    def fits(self, n: int) -> bool:
        return True

    def run(self, seqs, tokens, positions, slots):
        if tokens is None:
            assert self.last is not None and self.last[0] == seqs, "a chained step must bring the same sequences"
            tokens, self.chained = self.last[1], self.chained + 1
        else:
            tokens = torch.tensor(tokens)
        for s in seqs:
            self.rows[s] = self.rows.get(s, 0) + 1
        batch = Batch(tokens, torch.tensor(positions), torch.tensor(slots), seqs, [1] * len(seqs),
                      [p + 1 for p in positions])
        logits = self.model.forward(batch, self.cache)
        self.picked = greedy(logits)
        self.last = (list(seqs), self.picked.clamp(min=0))  # as the graph's inputs keep them: no NON_FINITE
        return logits

    def chosen(self, n: int) -> torch.Tensor:
        return self.picked[:n]
