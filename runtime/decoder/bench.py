"""`flashgen bench-model`: decode throughput of the decoder on random weights of a known architecture
(nothing to download), against the bandwidth limit: the weight and KV-cache bytes one decode step must
read, over the device's copy bandwidth. On a GPU, decode steps replay CUDA graphs unless `cuda_graphs` is
off, so that both can be reported. What a run would hold (weights as they load, KV cache, the prefill's
widest activation) is checked against the device's free memory before anything is allocated."""
from __future__ import annotations

import gc
import time
from dataclasses import replace
from typing import Callable

import torch

from flashgen.errors import FlashgenError
from flashgen.runtime.decoder.engine import Engine
from flashgen.runtime.decoder.sampling import SamplingParams
from flashgen.runtime.decoder.decode_graphs import bucket_for
from flashgen.runtime.decoder.memory import available_bytes, cache_bytes
from flashgen.runtime.decoder.model import Decoder
from flashgen.runtime.decoder.quant_modes import quant_mode
from flashgen.runtime.decoder.tensor_parallel import ShardedDecoder
from flashgen.runtime.serving.torch_ops import dispatcher
from flashgen.runtime.checkpoints.weights import ModelConfig, expected_shapes
from flashgen.schedules.moe_space import touched_experts

CONFIGS = {
    "llama3-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0, 8192, None, False, False),
    "smollm2-135m": ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 100000.0, 8192, None, False, True),
    "tiny": ModelConfig("llama", 256, 128, 352, 2, 4, 2, 32, 1e-5, 10000.0, 1024, None, False, False),
    # Mixtral-8x7B's layers (8 experts, top-2, 4096 x 14336), 2 of its 32: its 94 GB of bf16 weights, held
    # twice while they load, would not fit one GPU
    "mixtral-2l": ModelConfig("mixtral", 32000, 4096, 14336, 2, 32, 8, 128, 1e-5, 1e6, 32768, None, False, False,
                              num_experts=8, experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True,
                              moe_layers=(True, True)),
}


# What `flashgen bench-model` runs when not told: the settings of the committed GPU and CPU figures
# (benchmarks/results/). On the CPU the 8B model's float32 weights alone are 32 GB.
DEFAULTS = {"cuda": {"config": "llama3-8b", "batch": "1,16,64", "prompt_len": 2000, "new_tokens": 300},
            "cpu": {"config": "smollm2-135m", "batch": "1,8", "prompt_len": 64, "new_tokens": 32}}
GB = 1e9


def defaults() -> dict[str, str | int]:
    """This machine's defaults: its GPU's, else the CPU's."""
    return DEFAULTS["cuda" if torch.cuda.is_available() else "cpu"]


def random_weights(c: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the decoder reads for `c` (runtime/checkpoints/weights.py's `expected_shapes`): norms at one,
    matrices and biases normal with a 1/sqrt(fan-in) scale."""
    g = torch.Generator(device=device).manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * shape[-1] ** -0.5).to(dtype)

    return {name: torch.ones(shape, dtype=dtype, device=device) if name.endswith("norm.weight") else t(*shape)
            for name, shape in expected_shapes(c).items()}


def weight_bytes(c: ModelConfig, quant: str, dtype_bytes: int, batch: int | None = None) -> float:
    """Bytes of the weights a decode step of `batch` sequences reads: every dense linear, and of each
    MoE layer the router and the experts a random router touches on average (every expert when
    `batch` is None: what the model holds)."""
    qd, kd, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    attention = h * (qd + 2 * kd) + qd * h
    linear = 0.0
    for i in range(c.num_layers):
        if c.layer_moe(i):
            experts = c.num_experts if batch is None else touched_experts(batch, c.num_experts, c.experts_per_tok)
            linear += attention + 3 * h * (experts * c.moe_intermediate_size + c.shared_expert_intermediate_size)
        else:
            linear += attention + 3 * h * c.intermediate_size
    routers = sum(c.layer_moe(i) for i in range(c.num_layers)) * c.num_experts * h * dtype_bytes
    # (the lm_head stays in dtype)
    return linear * quant_mode(quant).weight_bytes(dtype_bytes) + routers + c.vocab_size * h * dtype_bytes


def step_bytes(c: ModelConfig, quant: str, dtype_bytes: int, batch: int, context: float) -> float:
    """Bytes one decode step must read: the weights once, and each sequence's keys and values of
    `context` tokens."""
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * dtype_bytes * batch * context
    return weight_bytes(c, quant, dtype_bytes, batch) + kv


def kv_cache_bytes(c: ModelConfig, dtype_bytes: int, batch: int, tokens: int) -> int:
    """The paged cache `decode` allocates for `batch` sequences of `tokens` tokens (16-token blocks)."""
    return cache_bytes(c, dtype_bytes, batch * -(-tokens // 16) + 4, 16)


def check_memory(config: str, c: ModelConfig, dtype: torch.dtype, dev: torch.device, batch: int,
                 prompt_len: int, new_tokens: int) -> None:
    """Refuses, with the estimate, a run that would not fit: random weights in `dtype` held twice while
    the decoder loads them (its fused and quantized copies beside the originals), the KV cache of the
    largest batch, and its prefill's gate/up projection and SiLU·mul output (all prompts prefill in one
    step)."""
    nbytes = torch.finfo(dtype).bits // 8
    weights = 2 * (weight_bytes(c, "bf16", nbytes) + c.vocab_size * c.hidden_size * nbytes)
    kv = kv_cache_bytes(c, nbytes, batch, prompt_len + new_tokens)
    activations = 3 * batch * prompt_len * c.intermediate_size * nbytes
    free = available_bytes(dev)
    if free is not None and weights + kv + activations > free:
        dt = str(dtype).removeprefix("torch.")
        raise FlashgenError(
            f"{config} at batch {batch} x {prompt_len + new_tokens} tokens needs about "
            f"{(weights + kv + activations) / GB:.1f} GB on the {dev.type} (weights {weights / GB:.1f} GB while "
            f"they load in {dt}, KV cache {kv / GB:.1f} GB, prefill {activations / GB:.1f} GB) and "
            f"{free / GB:.1f} GB is free: take a smaller --config, --batch or --prompt-len")


def build(config: str, quant: str, batch: int, prompt_len: int, new_tokens: int, device: str | None = None,
          tp: int = 1, progress: Callable[[str], None] | None = None) -> Decoder:
    """The decoder of bench config `config` on random weights (bf16 on a GPU, float32 on the CPU), its
    context long enough for `prompt_len` + `new_tokens`, once `check_memory` has found that it and the
    cache of `batch` such sequences fit; with `tp` > 1, this rank's part of the model split over the
    group's ranks (runtime/decoder/tensor_parallel.py). `progress` gets a line before the weights are
    made (seconds for the large configs)."""
    if config not in CONFIGS:
        raise FlashgenError(f"unknown config {config!r}; valid: {', '.join(CONFIGS)}")
    if prompt_len < 1 or new_tokens < 1:
        raise FlashgenError(f"prompt_len and new_tokens must be at least 1, got {prompt_len} and {new_tokens}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    c = replace(CONFIGS[config], max_position_embeddings=max(CONFIGS[config].max_position_embeddings,
                                                            prompt_len + new_tokens + 16))
    release(dev)  # (what an earlier run in this process left in torch's cache is free memory again)
    check_memory(config, c, dtype, dev, batch, prompt_len, new_tokens)
    if progress is not None:
        progress(f"{config}: making random {str(dtype).removeprefix('torch.')} weights on the {dev.type}...")
    return (Decoder if tp == 1 else ShardedDecoder)(c, random_weights(c, dtype, dev), dev, dtype, quant=quant)


def run(config: str, batches: list[int], prompt_len: int, new_tokens: int, quant: str, copy_gbs: float,
        device: str | None = None, cuda_graphs: bool = True, tp: int = 1,
        progress: Callable[[str], None] | None = None) -> list[dict]:
    """One row per batch; with `tp` > 1, this rank's run of the model split over the group's ranks
    (runtime/decoder/tensor_parallel.py), every rank calling it alike, `copy_gbs` then the ranks' together.
    `progress` gets a line as each phase starts (the weights, each batch)."""
    model = build(config, quant, max(batches), prompt_len, new_tokens, device, tp, progress)
    c, dev, dtype = model.c, model.device, model.dtype
    rows = []
    try:
        for b in batches:
            if progress is not None:
                progress(f"batch {b}: warming up (its kernels built or loaded), then timing {prompt_len}-token "
                         f"prefills and {new_tokens} new tokens...")
            free = available_bytes(dev)
            r = decode(model, b, prompt_len, new_tokens, cuda_graphs)
            nbytes = step_bytes(c, quant, torch.finfo(dtype).bits // 8, b, prompt_len + new_tokens / 2)
            limit = copy_gbs * 1e9 / nbytes * b  # tokens/s if each step only read its bytes once
            rows.append({**r, "bandwidth_limit_tokens_per_s": limit, "of_limit": r["decode_tokens_per_s"] / limit,
                         "free_gb_before": None if free is None else free / GB, "fallbacks": sorted(model.fallbacks),
                         # where the decode GEMMs' schedules came from (their M: the batch, or its graph bucket)
                         "decode_gemm_schedules": dispatcher().sources("contraction", rows=r.pop("graph_rows") or b)})
    finally:
        del model
        release(dev)
    return rows


def release(dev: torch.device) -> None:
    """Give what a finished run held (weights, KV caches, graphs' pools: unreachable once its objects
    are, cycles included) back to the device, so that the next mode or batch of the same process finds
    it free: torch's allocator keeps freed blocks for itself until emptied."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def decode(model: Decoder, batch: int, prompt_len: int, new_tokens: int, cuda_graphs: bool = True,
           seed: int | None = None) -> dict:
    """Time to first token and decode tokens/s of `batch` random prompts through a fresh engine; its
    kernels are built (or loaded) and its CUDA graph captured by an untimed generate first, of other
    random prompts (the same ones would find their blocks in the prefix cache and skip their prefill)."""
    c, dev = model.c, model.device
    per_seq = -(-(prompt_len + new_tokens) // 16)
    g = torch.Generator().manual_seed(batch if seed is None else seed)
    prompts = torch.randint(0, c.vocab_size, (batch, prompt_len), generator=g).tolist()
    engine = Engine(model, num_blocks=batch * per_seq + 4, cuda_graphs=cuda_graphs)
    engine.generate(torch.randint(0, c.vocab_size, (batch, prompt_len), generator=g).tolist(),
                    SamplingParams(max_new_tokens=2))
    ids = [engine.add(p, SamplingParams(max_new_tokens=new_tokens)) for p in prompts]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    engine.step()  # every prefill, and the first token of each request
    sync()
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    while engine.running or engine.pending:
        engine.step()
    sync()
    decode_s = time.perf_counter() - t1
    if failed := next((engine.finished[i].error for i in ids if engine.finished[i].error), None):
        raise FlashgenError(f"a request of the batch failed: {failed}")
    steps = sum(len(engine.finished[i].output) for i in ids) // batch - 1  # decode steps after the first token
    return {"batch": batch, "ttft_s": ttft, "decode_tokens_per_s": batch * steps / decode_s if steps else 0.0,
            "steps": steps, "cuda_graphs": engine.graphs is not None,
            # the row count its decode GEMMs ran at: the graphs' bucket (no reference to the graphs, which
            # hold the engine's cache, outlives this call)
            "graph_rows": bucket_for(batch, engine.graphs.sizes) if engine.graphs is not None else None}
