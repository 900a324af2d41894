"""A model folder as a ready Engine: the memory check, then the whole decoder or this rank's part of it,
in a quant mode. `flashgen generate` and `flashgen serve` both build theirs here, so a model serves as it
generates."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from flashgen.runtime.checkpoints.weights import ModelConfig, check_weights, load_weights
from flashgen.runtime.decoder.engine import Engine
from flashgen.runtime.decoder.memory import cache_bytes, check_fits
from flashgen.runtime.decoder.model import Decoder
from flashgen.runtime.decoder.tensor_parallel import ShardedDecoder, shard_config


def load_engine(folder: Path, config: ModelConfig, device: torch.device, cache_blocks: int, block_size: int,
                tp: int = 1, quant: str = "bf16", prefix_cache: bool = True,
                status: Callable[[str], None] | None = None) -> Engine:
    """An engine over `folder`'s model on `device` (this rank's part of it when `tp` > 1, each rank
    reading only its part of each tensor) with a KV cache of `cache_blocks` blocks; refused in one line
    before anything loads where the weights (as float, an upper bound for the quantized modes) and the
    cache would not fit the device's free memory. `prefix_cache`: the engine's automatic prefix caching
    (runtime/decoder/engine.py). `status` gets one line before the weights load (they take seconds)."""
    nbytes = 2 if device.type == "cuda" else 4
    weights = sum(math.prod(shape) for _, _, shape in check_weights(folder, config).values()) * nbytes
    check_fits(f"{folder.name} with a KV cache of {cache_blocks} blocks", weights // tp +
               cache_bytes(shard_config(config, tp), nbytes, cache_blocks + 1, block_size), device,
               "pass fewer --cache-blocks")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if status is not None:
        ranks = f", over {tp} ranks" if tp > 1 else ""
        status(f"loading {folder} ({weights / 1e9:.2f} GB as {str(dtype).removeprefix('torch.')}{ranks}) on {device.type}...")
    model = Decoder(config, load_weights(folder, config), device, dtype, quant) if tp == 1 else \
        ShardedDecoder(config, folder, device, dtype, quant)
    return Engine(model, num_blocks=cache_blocks, block_size=block_size, tp=tp, prefix_cache=prefix_cache)
