"""Tensor parallelism on the device (-m gpu): NCCL ranks, one per GPU (one rank, and two where there are
two GPUs), their decode steps replayed from CUDA graphs and chained, against one process in bf16,
w4a16 and w8a8. Every greedy token of a ranks' run is one the whole model's logits, teacher-forced on
the same tokens, rank first within bf16 tolerance, and the prompt's logits agree within it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashgen.runtime.bench import random_weights
from flashgen.runtime.engine import Engine, SamplingParams
from flashgen.runtime.model import Decoder
from flashgen.runtime.model_config import ModelConfig
from flashgen.runtime.ranks import launch
from flashgen.runtime.tensor_parallel import ShardedDecoder
from tests.prefill import prefill_logits

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

# K of o and down split in two stays a multiple of 128 (w4a16's groups); vocab 500, padded on two ranks
CONFIG = ModelConfig("llama", 500, 256, 512, 2, 4, 2, 64, 1e-5, 10000.0, 512, None, False, False)
PROMPT = [3, 17, 99, 250, 8, 41, 7, 480, 5]
PROMPTS = [[1, 5, 9, 20, 33], [42], [7, 8, 100, 3, 4, 5, 6, 77, 2, 1]]
SEED, NEW = 5, 16
DEGREES = [1] + ([2] if torch.cuda.device_count() >= 2 else [])


def _ranks(device: torch.device, mode: str, out: Path) -> None:
    """In each rank: the prompt's logits and NEW greedy tokens of PROMPTS, decode steps from CUDA graphs."""
    tp = dist.get_world_size()
    model = ShardedDecoder(CONFIG, random_weights(CONFIG, torch.bfloat16, device, SEED), device, torch.bfloat16, mode)
    engine = Engine(model, num_blocks=64, tp=tp)
    tokens = [r.output for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))]
    assert engine.graphs is not None and engine.graphs.graphs, "decode steps were not captured"
    logits = prefill_logits(model, PROMPT).float().cpu()
    torch.save({"tokens": tokens, "logits": logits}, out / f"rank{model.rank}.pt")


@pytest.mark.parametrize("mode", ["bf16", "w4a16", "w8a8"])
@pytest.mark.parametrize("tp", DEGREES)
def test_ranks_decode_as_one_process(tp, mode, tmp_path):
    launch(tp, _ranks, (mode, tmp_path), timeout_s=120)
    runs = [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp)]
    assert all(r["tokens"] == runs[0]["tokens"] for r in runs)
    whole = Decoder(CONFIG, random_weights(CONFIG, torch.bfloat16, torch.device("cuda"), SEED), "cuda",
                    torch.bfloat16, mode)
    ref = prefill_logits(whole, PROMPT).float().cpu()
    tol = 0.03 * ref.abs().max()
    assert (runs[0]["logits"] - ref).abs().max() <= tol
    for prompt, tokens in zip(PROMPTS, runs[0]["tokens"]):
        assert len(tokens) == NEW
        forced = prefill_logits(whole, prompt + tokens[:-1]).float().cpu()[len(prompt) - 1:]
        chosen = forced.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (chosen >= forced.max(1).values - tol).all(), (prompt, tokens)
