"""For the checkpoint tests: a tiny transformers model written as a folder, and the decoder's logits for
every token of one prompt, prefilled into a fresh engine's cache, to compare with transformers' forward."""
from __future__ import annotations

from pathlib import Path

import torch

from flashgen.runtime.decoder.model import Decoder
from flashgen.runtime.decoder.scoring import prompt_logits


def prefill_logits(model: Decoder, prompt: list[int], num_blocks: int = 32) -> torch.Tensor:
    return prompt_logits(model, prompt, num_blocks)


def write_checkpoint(hf: torch.nn.Module, folder: Path, also: tuple[str, ...] = ()) -> Path:
    """Save `hf` (eager attention, for the reference) after drawing its biases, and the parameters whose
    names end in `also`, at std 0.5: random init leaves them at zero or near-uniform, where they would
    not count."""
    for name, p in hf.named_parameters():
        if name.endswith((".bias", *also)):
            torch.nn.init.normal_(p, std=0.5)
    hf.config._attn_implementation = "eager"
    hf.eval().save_pretrained(folder)
    return folder
