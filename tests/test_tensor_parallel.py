"""Tensor-parallel decoding on the CPU: two ranks over gloo give the greedy tokens and the logits of one
process, on a tiny random Llama with every bias and an odd vocabulary (its lm_head padded) in every
quantization mode, and on a GQA model with one KV head (replicated on both ranks) and tied embeddings;
every rank ends with the same tokens. Bad input is one line: a degree that does not split the heads,
the KV groups or the MLP, more ranks than GPUs, a rank that raises or stalls mid-step (the other fails
within the group's timeout, no hang, and the launcher stops the rest), a rendezvous port in use (at once)."""
from __future__ import annotations

import functools
import os
import re
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from flashgen.cli import main
from flashgen.errors import FlashgenError
from flashgen.runtime.decoder.bench import CONFIGS, random_weights
from flashgen.runtime.decoder.engine import Engine
from flashgen.runtime.decoder.sampling import SamplingParams
from flashgen.runtime.decoder.model import Decoder
from flashgen.runtime.checkpoints.model_config import ModelConfig
from flashgen.runtime.decoder.ranks import launch, start_rank
from flashgen.runtime.decoder.tensor_parallel import ShardedDecoder, check_gpus, check_tp, shard_weights
from flashgen.runtime.checkpoints.weights import load_weights
from tests.prefill import prefill_logits

# q, k, v, o and MLP biases; K of o and down 256 and 512, so split in two each rank's int4 groups of 128
# are the whole model's; vocab 251, odd
DENSE = ModelConfig("llama", 251, 256, 512, 2, 4, 2, 64, 1e-5, 10000.0, 256, None, True, False, o_bias=True,
                    mlp_bias=True)
GQA = ModelConfig("llama", 256, 64, 160, 2, 4, 1, 16, 1e-5, 10000.0, 256, None, False, True)  # 1 KV head, tied
MODES = ("bf16", "w8a16", "w4a16", "w8a8", "w4a8", "fp8", "mixed")
SAME_QUANTIZATION = ("bf16", "w4a16")  # quantized alike split or whole (per-channel scales span each rank's K only)
PROMPT = [3, 17, 99, 250, 8, 41, 7]
PROMPTS = [[1, 5, 9, 20, 33], [42], [7, 8, 100, 3, 4, 5, 6, 77, 2, 1]]
SEED = 3
LONG_S = 600  # a timeout or grace no test here may wait out: a launch that returns did not wait it


def run(model: Decoder, tp: int | None = None) -> dict:
    """Every token's logits of PROMPT, and 8 tokens of each of PROMPTS, batched: greedy, and sampled."""
    engine = Engine(model, num_blocks=48, tp=tp)
    greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8))
    sampled = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.9, top_k=50, min_p=0.01,
                                                      repetition_penalty=1.3, seed=11))
    return {"logits": prefill_logits(model, PROMPT), "tokens": [r.output for r in greedy],
            "sampled": [r.output for r in sampled]}


CASES = {"dense": (DENSE, MODES), "gqa": (GQA, ("bf16", "w8a8"))}


def _split_runs(device: torch.device, out: Path) -> None:
    """In each rank: `run` of each case's ShardedDecoder in each of its modes, saved per rank."""
    results = {}
    for name, (config, modes) in CASES.items():
        for mode in modes:
            weights = random_weights(config, torch.float32, device, SEED)
            results[name, mode] = run(ShardedDecoder(config, weights, device, quant=mode), tp=2)
    torch.save(results, out / f"rank{dist.get_rank()}.pt")


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> list[dict]:
    """Each rank's results, from one launch of two ranks."""
    folder = tmp_path_factory.mktemp("split")
    launch(2, _split_runs, (folder,), timeout_s=LONG_S)
    return [torch.load(folder / f"rank{r}.pt") for r in range(2)]


@functools.cache
def whole(config: ModelConfig, mode: str) -> dict:
    return run(Decoder(config, random_weights(config, torch.float32, torch.device("cpu"), SEED), quant=mode))


def check_same(split: list[dict], case: str, mode: str) -> None:
    """Both ranks' tokens are rank 0's (the sampled ones broadcast by it); logits within float32 rounding
    of one process (the same quantization), or no further from it than its quantization is from the
    float model."""
    for kind in ("tokens", "sampled"):
        assert split[1][case, mode][kind] == split[0][case, mode][kind]
    config = CASES[case][0]
    ref, got = whole(config, mode), split[0][case, mode]
    err = (got["logits"] - ref["logits"]).abs().max()
    if mode in SAME_QUANTIZATION:
        assert got["tokens"] == ref["tokens"] and got["sampled"] == ref["sampled"]
        assert err < 1e-4 * ref["logits"].abs().max(), err
    else:
        quantization = (ref["logits"] - whole(config, "bf16")["logits"]).abs().max()
        assert 0 < err <= 2 * quantization, (err, quantization)


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_compute_as_one_process(split, mode):
    check_same(split, "dense", mode)


@pytest.mark.parametrize("mode", CASES["gqa"][1])
def test_fewer_kv_heads_than_ranks(split, mode):
    check_same(split, "gqa", mode)


def test_each_rank_holds_its_heads_and_vocabulary_rows():
    """GQA with 4 query heads and 1 KV head on 2 ranks: query heads 0-1 and 2-3, the KV head on both;
    the tied lm_head split by rows, the second rank's padded with zeros."""
    c = ModelConfig("llama", 7, 8, 6, 1, 4, 1, 2, 1e-5, 1e4, 16, None, False, True)
    w = random_weights(c, torch.float32, torch.device("cpu"), SEED)
    for rank in range(2):
        s = shard_weights(c, w, 2, rank)
        q = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(s[q], w[q][rank * 4:(rank + 1) * 4])
        assert torch.equal(s["model.layers.0.self_attn.k_proj.weight"], w["model.layers.0.self_attn.k_proj.weight"])
        o = "model.layers.0.self_attn.o_proj.weight"
        assert torch.equal(s[o], w[o][:, rank * 4:(rank + 1) * 4])
        head = s["lm_head.weight"]
        assert head.shape == (4, 8)
        assert torch.equal(head[:4 - rank], w["model.embed_tokens.weight"][rank * 4:rank * 4 + 4 - rank])
        assert not head[4 - rank:].any()


@pytest.mark.parametrize("change, tp, message", [
    ({}, 3, "tp=3 does not divide the model's 4 attention heads"),
    ({"num_heads": 6, "num_kv_heads": 3}, 2, "tp=2 neither divides the model's 3 KV heads nor is a multiple"),
    ({"intermediate_size": 351}, 2, "tp=2 does not divide the model's intermediate size 351"),
    ({}, 0, "tp must be an integer of at least 1, got 0"),
    ({"model_type": "mixtral", "num_experts": 4, "experts_per_tok": 2, "moe_intermediate_size": 64,
      "moe_layers": (True, True)}, 2, "this mixtral model has MoE layers"),
])
def test_a_degree_the_model_cannot_split_is_refused(change, tp, message):
    from dataclasses import replace

    with pytest.raises(FlashgenError, match=message.replace("(", r"\(")):
        check_tp(replace(CONFIGS["tiny"], **change), tp)


def test_more_ranks_than_gpus_is_refused():
    check_gpus(2, 2)
    with pytest.raises(FlashgenError, match="tp=4 needs 4 GPUs, one per rank; this machine has 1"):
        check_gpus(4, 1)


def test_a_split_engine_needs_a_split_model():
    c = CONFIGS["tiny"]
    model = Decoder(c, random_weights(c, torch.float32, torch.device("cpu"), SEED))
    with pytest.raises(FlashgenError, match=r"Engine\(tp=2\) needs a decoder split over 2 ranks"):
        Engine(model, tp=2)
    with pytest.raises(FlashgenError, match="runs in each rank of a process group"):
        ShardedDecoder(c, random_weights(c, torch.float32, torch.device("cpu"), SEED))


def _fails_mid_step(device: torch.device, how: str, step_timeout_s: float) -> None:
    """Both ranks decode in a group whose collectives wait `step_timeout_s`, made once both hold their
    weights (so that start-up, however slow, is not read as a stall); rank 1's third linear of its second
    step raises (dies, or stalls)."""
    c = CONFIGS["tiny"]
    weights = random_weights(c, torch.float32, device, SEED)
    dist.barrier()
    model = ShardedDecoder(c, weights, device, group=dist.new_group(timeout=timedelta(seconds=step_timeout_s)))
    engine = Engine(model, num_blocks=16, tp=2)
    engine.add(PROMPTS[0], SamplingParams(max_new_tokens=4))
    engine.step()
    if model.rank == 1:
        linear, calls = model.linear, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3:
                if how == "raise":
                    raise RuntimeError("injected fault")
                if how == "die":
                    os._exit(3)
                time.sleep(3600)
            return linear(*args, **kwargs)
        model.linear = failing
    engine.step()



def test_a_rank_that_raises_mid_step_stops_the_other_at_once():
    """Rank 0 waits in an all-reduce that could wait LONG_S, and the launcher would give it LONG_S to
    stop: it stops, with its own line, because gloo saw rank 1 gone."""
    t0 = time.monotonic()
    with pytest.raises(FlashgenError) as e:
        launch(2, _fails_mid_step, ("raise", LONG_S), timeout_s=LONG_S, grace_s=LONG_S)
    assert time.monotonic() - t0 < LONG_S
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("rank 1: step failed: RuntimeError: injected fault (then rank 0: all-reduce failed: "
                          "another rank died or did not answer in time"), msg
    assert "Timed out" not in msg and "stopped" not in msg, msg


def test_a_rank_that_dies_mid_step_is_named_before_the_one_that_lost_it():
    """Rank 1's process ends without a word; rank 0 reports the peer it lost, after it: the error names
    rank 1 first."""
    t0 = time.monotonic()
    with pytest.raises(FlashgenError) as e:
        launch(2, _fails_mid_step, ("die", LONG_S), timeout_s=LONG_S, grace_s=LONG_S)
    assert time.monotonic() - t0 < LONG_S
    msg = str(e.value)
    assert msg.startswith("rank 1: exited with code 3 (then rank 0: all-reduce failed: another rank died or did "
                          "not answer in time"), msg


def test_a_stalled_rank_is_stopped_as_soon_as_the_other_times_out():
    """Rank 0's all-reduce gives up after its group's timeout (2 s), and the launcher stops rank 1 then,
    without the LONG_S grace a rank's own failure gets (a stalled rank never stops by itself)."""
    t0 = time.monotonic()
    with pytest.raises(FlashgenError) as e:
        launch(2, _fails_mid_step, ("stall", 2), timeout_s=LONG_S, grace_s=LONG_S)
    assert time.monotonic() - t0 < LONG_S
    msg = str(e.value)
    assert re.fullmatch(r"rank 0: all-reduce failed: another rank died or did not answer in time \(RuntimeError: "
                        r".*Timed out waiting 2000ms.*\) \(then rank 1: stopped, still running\)", msg), msg


def _fails_while_the_other_computes(device: torch.device) -> None:
    """Rank 1 fails at once; rank 0 computes for an hour, in no collective that could see it gone."""
    if dist.get_rank() == 1:
        raise FlashgenError("injected fault")
    time.sleep(3600)


def test_a_failure_stops_the_ranks_still_running_after_the_grace():
    t0 = time.monotonic()
    with pytest.raises(FlashgenError, match=r"^rank 1: injected fault \(then rank 0: stopped, still running\)$"):
        launch(2, _fails_while_the_other_computes, timeout_s=LONG_S, grace_s=1)
    assert time.monotonic() - t0 < LONG_S  # the grace, not the group's timeout


def _never_runs(device: torch.device, marker: Path) -> None:
    marker.write_text("ran")


def test_a_rendezvous_port_in_use_is_one_line_before_any_rank_starts(tmp_path):
    """The launcher binds the port before it spawns a rank: with a rendezvous timeout of an hour, the
    error comes anyway, and no rank ran."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(FlashgenError, match=rf"^cannot host the ranks' rendezvous on 127\.0\.0\.1:{port}: "
                                                r"DistNetworkError: .*address already in use$"):
            launch(2, _never_runs, (tmp_path / "ran",), timeout_s=3600, port=port)
    assert not (tmp_path / "ran").exists()


def test_torchrun_variables_naming_a_port_in_use_are_one_line_at_once(monkeypatch):
    """Rank 0 of a launch that gives the variables but no store binds MASTER_PORT itself: a port in use
    fails there and then, not after the rendezvous timeout (an hour here)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        with pytest.raises(FlashgenError, match=rf"^rank 0: joining the group at 127\.0\.0\.1:{port} failed: "
                                                r"DistNetworkError: .*address already in use$"):
            start_rank(2, timeout_s=3600)
    assert not dist.is_initialized()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from generate_warm_start import tiny_folder
    return tiny_folder(tmp_path_factory.mktemp("tiny-llama"))


def test_a_rank_reads_only_its_part_of_a_checkpoint(folder):
    """Each rank's tensors read from the folder's slices are those cut from the whole model's."""
    c = ModelConfig.from_folder(folder)
    whole = load_weights(folder, c)
    for rank in range(2):
        read, cut = shard_weights(c, folder, 2, rank), shard_weights(c, whole, 2, rank)
        assert read.keys() == cut.keys()
        assert all(torch.equal(read[k], cut[k]) for k in cut)
        q = "model.layers.1.self_attn.q_proj.weight"
        assert read[q].shape[0] == whole[q].shape[0] // 2


def test_generate_with_two_ranks_prints_what_one_process_does(folder, capfd):
    args = ["generate", "--model", str(folder), "--prompt", "w1 w2 w3", "--max-new-tokens", "6"]
    assert main(args) == 0
    one = capfd.readouterr().out
    assert main(args + ["--tp", "2"]) == 0
    assert capfd.readouterr().out == one and len(one.split()) == 6
    assert main(args + ["--tp", "3"]) == 2
    assert capfd.readouterr().err == "flashgen: error: tp=3 does not divide the model's 4 attention heads\n"
