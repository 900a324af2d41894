"""Loading a Hugging Face Llama-family checkpoint folder: config.json and safetensors weights, sharded
or not. Only what the decoder needs is read; problems are clear errors naming the file."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from flashgen.errors import FlashgenError

SUPPORTED = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    sliding_window: int | None
    qkv_bias: bool
    tie_word_embeddings: bool

    @staticmethod
    def from_folder(folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        try:
            c = json.loads(path.read_text())
        except FileNotFoundError:
            raise FlashgenError(f"{folder} is not a model folder: it has no config.json") from None
        except (OSError, json.JSONDecodeError) as e:
            raise FlashgenError(f"{path} is unreadable: {e}") from None
        kind = c.get("model_type")
        if kind not in SUPPORTED:
            raise FlashgenError(f"{folder}: model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED)}")
        heads = c["num_attention_heads"]
        rope = c.get("rope_parameters") or {}
        return ModelConfig(
            model_type=kind, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            sliding_window=c.get("sliding_window") if kind == "mistral" else None,
            qkv_bias=kind == "qwen2" or bool(c.get("attention_bias", False)),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)))


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name: model.safetensors, or the shards its index names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise FlashgenError(f"{index} is unreadable: {e}") from None
    elif (folder / "model.safetensors").exists():
        shards = ["model.safetensors"]
    else:
        raise FlashgenError(f"{folder} has no model.safetensors nor model.safetensors.index.json")
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        path = folder / shard
        if not path.exists():
            raise FlashgenError(f"{folder}: shard {shard} named by the index is missing")
        try:
            out.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as e:
            raise FlashgenError(f"{path} is truncated or not a safetensors file ({e})") from None
    return out
