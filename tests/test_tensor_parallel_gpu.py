"""Tensor parallelism on the device (-m gpu): NCCL ranks, one per GPU (one rank, and two where there are
two GPUs), their decode steps replayed from CUDA graphs and chained, against one process in bf16,
w4a16 and w8a8. Every greedy token of a ranks' run is one the whole model's logits, teacher-forced on
the same tokens, rank first within bf16 tolerance, and the prompt's logits agree within it. A rank that
stalls, eagerly or between graph replays, ends the run once the others' collectives time out."""
from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashgen.errors import FlashgenError
from flashgen.runtime.decoder.bench import random_weights
from flashgen.runtime.decoder.engine import Engine
from flashgen.runtime.decoder.sampling import SamplingParams
from flashgen.runtime.decoder.model import Decoder
from flashgen.runtime.checkpoints.model_config import ModelConfig
from flashgen.runtime.decoder.ranks import launch
from flashgen.runtime.decoder.tensor_parallel import ShardedDecoder
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


STALL_S = 300  # how long the stalled rank sleeps: a run that lasts it was ended by the sleeper waking, not a timeout


def _stalls(device: torch.device, cuda_graphs: bool) -> None:
    """Both ranks decode in a group whose collectives wait 10 s, made once both hold their weights; rank 1
    stalls before its third step (a decode step, replayed from a CUDA graph with `cuda_graphs`)."""
    weights = random_weights(CONFIG, torch.bfloat16, device, SEED)
    dist.barrier()
    model = ShardedDecoder(CONFIG, weights, device, torch.bfloat16,
                           group=dist.new_group(timeout=timedelta(seconds=10)))
    engine = Engine(model, num_blocks=64, tp=2, cuda_graphs=cuda_graphs)
    engine.add(PROMPTS[0], SamplingParams(max_new_tokens=NEW))
    engine.step()
    engine.step()
    if model.rank == 1:
        time.sleep(STALL_S)
    engine.step()
    torch.cuda.synchronize()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_stalled_rank_ends_the_run_when_the_other_times_out(cuda_graphs):
    """Rank 0's NCCL collective times out after 10 s (its process reporting that, or ended by NCCL's
    watchdog), and the launcher stops rank 1, still stalled, within its grace: long before STALL_S."""
    t0 = time.monotonic()
    with pytest.raises(FlashgenError) as e:
        launch(2, _stalls, (cuda_graphs,), timeout_s=STALL_S * 2)
    assert time.monotonic() - t0 < STALL_S
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rank 0: ") and msg.endswith("(then rank 1: stopped, still running)"), msg
