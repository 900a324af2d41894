"""The decoder's logits for every token of one prompt, prefilled into a fresh engine's cache: what the
checkpoint tests compare with transformers' full forward."""
from __future__ import annotations

import torch

from flashgen.runtime.engine import Engine
from flashgen.runtime.model import Batch, Decoder


def prefill_logits(model: Decoder, prompt: list[int], num_blocks: int = 32) -> torch.Tensor:
    eng = Engine(model, num_blocks=num_blocks)
    eng.cache.manager.reserve(0, len(prompt))
    table, bs = eng.cache.manager.tables[0], eng.cache.manager.block_size
    batch = Batch(torch.tensor(prompt), torch.arange(len(prompt)),
                  torch.tensor([table[p // bs] * bs + p % bs for p in range(len(prompt))]), [0], [len(prompt)],
                  [len(prompt)])
    return model.forward(batch, eng.cache, last_only=False)
