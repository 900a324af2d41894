"""Every position's logits of a token sequence in one forward: what scoring a text needs (perplexity,
a comparison with another implementation), where generation keeps only each sequence's last row."""
from __future__ import annotations

import torch

from flashgen.runtime.decoder.engine import Engine
from flashgen.runtime.decoder.model import Batch, Decoder

BLOCK_TOKENS = 16  # the cache's block size


def prompt_logits(model: Decoder, prompt: list[int], num_blocks: int | None = None) -> torch.Tensor:
    """The logits [len(prompt), vocab] of `prompt` prefilled as one sequence into a fresh engine's cache
    of `num_blocks` blocks (None: just enough for the prompt); row i predicts token i + 1. The prompt
    runs as one prefill, as a generation's prefill runs it (a prefill replays no CUDA graph)."""
    eng = Engine(model, num_blocks=num_blocks or -(-len(prompt) // BLOCK_TOKENS), block_size=BLOCK_TOKENS,
                 cuda_graphs=False)
    table = eng.cache.manager.reserve(0, len(prompt))
    dev = model.device
    slots = [table[p // BLOCK_TOKENS] * BLOCK_TOKENS + p % BLOCK_TOKENS for p in range(len(prompt))]
    batch = Batch(torch.tensor(prompt, device=dev), torch.arange(len(prompt), device=dev),
                  torch.tensor(slots, device=dev), [0], [len(prompt)], [len(prompt)])
    return model.forward(batch, eng.cache, last_only=False)
