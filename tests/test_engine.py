"""The engine never loses a request: malformed requests are refused at `add` in one line; a request that
fails in a step fails alone (sampling, NaN/inf logits) or with its step (forward), its blocks freed;
admission is first come, first served, so a long request is not starved; requests can be aborted;
finished ones are handed over, not kept. On the CPU, tiny random Llama."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from flashgen.errors import FlashgenError
from flashgen.runtime.decoder.bench import CONFIGS, random_weights
from flashgen.runtime.decoder.engine import Engine
from flashgen.runtime.decoder.sampling import SamplingParams
from flashgen.runtime.decoder.model import Decoder
from tests.eager_graphs import EagerGraphs

PROMPTS = [[1, 5, 9, 20, 33], [7, 8, 100, 3, 4, 5, 6, 77, 2, 1, 0, 9, 8, 7, 6, 5, 4, 3, 11, 12], [42]]


@pytest.fixture(scope="module")
def model() -> Decoder:
    c = CONFIGS["tiny"]  # vocab 256, context 1024
    return Decoder(c, random_weights(c, torch.float32, torch.device("cpu"), seed=1))


def solo(model: Decoder, prompt: list[int], n: int) -> list[int]:
    """The greedy output of `prompt` run alone."""
    return Engine(model, num_blocks=64).generate([prompt], SamplingParams(max_new_tokens=n))[0].output


def all_free(eng: Engine) -> bool:
    m = eng.cache.manager
    return sorted(m.free + list(m.cached)) + [m.pad] == list(range(len(eng.cache.k[0]))) and not m.tables \
        and not m.refs  # (the pad block last; idle cached blocks are not leaked)


def run_out(eng: Engine) -> None:
    while eng.waiting or eng.running or eng.pending:
        eng.step()


@pytest.mark.parametrize("prompt, params, message", [
    ([1], dict(temperature=math.nan), "temperature must be a finite number >= 0, got nan"),
    ([1], dict(temperature=math.inf), "temperature must be a finite number >= 0, got inf"),
    ([1], dict(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
    ([1], dict(temperature="0.7"), "temperature must be a finite number >= 0, got '0.7'"),
    ([1], dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
    ([1], dict(top_p=1.5), "top_p must be in (0, 1], got 1.5"),
    ([1], dict(top_p=math.nan), "top_p must be in (0, 1], got nan"),
    ([1], dict(top_k=-1), "top_k must be an integer >= 0, got -1"),
    ([1], dict(top_k=2.5), "top_k must be an integer >= 0, got 2.5"),
    ([1], dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
    ([1], dict(min_p=math.nan), "min_p must be in [0, 1], got nan"),
    ([1], dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0, got 0"),
    ([1], dict(repetition_penalty=math.inf), "repetition_penalty must be a finite number > 0, got inf"),
    ([1], dict(repetition_penalty="1.1"), "repetition_penalty must be a finite number > 0, got '1.1'"),
    ([1], dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
    ([1], dict(max_new_tokens=True), "max_new_tokens must be an integer >= 1, got True"),
    ([1], dict(seed=-1), "seed must be an integer in [0, 2**63), got -1"),
    ([1], dict(seed=2 ** 63), f"seed must be an integer in [0, 2**63), got {2 ** 63}"),
    ([1], dict(stop_tokens=(2, "x")), "stop_tokens must be a tuple of integers, got (2, 'x')"),
    ([1], dict(stop_tokens=2), "stop_tokens must be a tuple of integers, got 2"),
    ([], {}, "prompt must be a non-empty list of token ids, got []"),
    ("abc", {}, "prompt must be a non-empty list of token ids, got 'abc'"),
    ([1, 256], {}, "prompt token 256 at position 1 is not an id in the vocabulary [0, 256)"),
    ([-1], {}, "prompt token -1 at position 0 is not an id in the vocabulary [0, 256)"),
    ([1, 2.0], {}, "prompt token 2.0 at position 1 is not an id in the vocabulary [0, 256)"),
])
def test_add_refuses_malformed_requests_in_one_line(model, prompt, params, message):
    eng = Engine(model, num_blocks=8)
    with pytest.raises(FlashgenError) as e:
        eng.add(prompt, SamplingParams(**params))
    assert str(e.value) == message
    with pytest.raises(FlashgenError, match="top_p"):  # generate checks every prompt before queueing any
        eng.generate([[1, 2], [3]], SamplingParams(top_p=0.0))
    assert not eng.waiting and not eng.finished and all_free(eng)


def test_requests_this_engine_cannot_serve_finish_with_their_reason(model):
    eng = Engine(model, num_blocks=4, block_size=16)  # 64 tokens
    too_big, fine = eng.generate([[3] * 60, [3] * 5], SamplingParams(max_new_tokens=8))
    assert "more KV cache blocks" in too_big.error and not too_big.output
    assert fine.error == "" and len(fine.output) == 8
    assert "exceeds the model's context" in eng.generate([[3] * 1020], SamplingParams(max_new_tokens=8))[0].error


@pytest.mark.parametrize("params", [dict(temperature=1e-300), dict(temperature=5e-324),
                                    dict(temperature=1.0, top_p=1e-300), dict(temperature=1.0, top_p=1e-46),
                                    dict(temperature=1e-300, top_k=3)])
def test_extreme_valid_sampling_is_greedy_not_an_error(model, params):
    """A temperature or top_p that `add` accepts but float32 rounds to 0 (1e-300 made the logits inf - inf
    = NaN, and top_p 1e-300 kept no token: "sampling failed" for a valid request) samples as its limit
    does: the greedy token."""
    out = Engine(model, num_blocks=16).generate([PROMPTS[0]], SamplingParams(max_new_tokens=6, seed=5, **params))[0]
    assert out.error == "" and out.output == solo(model, PROMPTS[0], 6)


def test_a_tiny_repetition_penalty_samples_the_seen_tokens(model):
    """A penalty of 5e-324, which `add` accepts, overflows the seen tokens' positive logits to inf: they
    tie at the top instead of making the row NaN ("sampling failed"), so only seen tokens are drawn."""
    p = SamplingParams(max_new_tokens=6, temperature=1.0, repetition_penalty=5e-324, seed=2)
    out = Engine(model, num_blocks=16).generate([PROMPTS[1]], p)[0]
    assert out.error == "" and len(out.output) == 6 and set(out.output) <= set(PROMPTS[1])


def test_a_request_failing_to_sample_fails_alone(model):
    """One request whose sampling raises in its prefill step (NaN temperature) and one in a later decode
    step (top_p 0: nothing to draw from), both past `add`'s checks: each fails with its reason, the
    greedy ones batched with them give their solo outputs, and every block is back."""
    want = [solo(model, p, 10) for p in PROMPTS]
    eng = Engine(model, num_blocks=16)
    ids = [eng.add(p, SamplingParams(max_new_tokens=10)) for p in PROMPTS]
    nan = eng.add(PROMPTS[0], SamplingParams(max_new_tokens=10, temperature=0.8))
    late = eng.add(PROMPTS[1], SamplingParams(max_new_tokens=10, temperature=0.8, seed=3))
    eng.waiting[-2].params = replace(eng.waiting[-2].params, temperature=math.nan)
    eng.step()
    eng.step()
    eng.step()
    req = next(r for r in eng.running if r.id == late)
    # (admitted a step after the others, to share the prompt block PROMPTS[1]'s first request computes)
    assert len(req.output) == 2 and req.cached_tokens == 16
    req.params = replace(req.params, top_p=0.0)
    run_out(eng)
    assert eng.finished[nan].error.startswith("sampling failed: RuntimeError") and not eng.finished[nan].output
    assert eng.finished[late].error.startswith("sampling failed: RuntimeError") and len(eng.finished[late].output) == 2
    assert [eng.finished[i].output for i in ids] == want and all(eng.finished[i].error == "" for i in ids)
    assert all_free(eng)


def test_a_failing_forward_fails_its_step_and_the_engine_serves_on(model):
    """A prompt id past `add`'s check (an index error in the embedding) fails the step's requests, the
    running one included, with the reason, and frees their blocks; a request waiting for blocks then
    runs to its solo output."""
    eng = Engine(model, num_blocks=8, block_size=16)
    running = eng.add(PROMPTS[0], SamplingParams(max_new_tokens=10))  # 1 block
    eng.step()
    eng.step()
    bad = eng.add(PROMPTS[1], SamplingParams(max_new_tokens=10))      # 2 blocks
    eng.waiting[-1].prompt[3] = 10 ** 6
    waits = eng.add(list(range(100)), SamplingParams(max_new_tokens=10))  # 7 blocks: only 5 are free
    eng.step()
    for rid in (running, bad):
        assert eng.finished[rid].error.startswith("step failed: IndexError"), eng.finished[rid].error
    assert [r.id for r in eng.waiting] == [waits] and not eng.running and not eng.cache.manager.tables
    run_out(eng)
    assert eng.finished[waits].error == "" and eng.finished[waits].output == solo(model, list(range(100)), 10)
    assert all_free(eng)


def big_request_wait(model: Decoder, stream: int) -> int:
    """Steps that a request needing 8 of the cache's 10 blocks waits, submitted at step 10 of a stream of
    one short request (1 block, 6 new tokens) per step lasting `stream` steps."""
    eng = Engine(model, num_blocks=10, block_size=16)
    for step in range(10 * stream):
        if step < stream:
            eng.add([1 + step, 2, 3, 4, 5], SamplingParams(max_new_tokens=6))
        if step == 10:
            big = eng.add(list(range(100)), SamplingParams(max_new_tokens=28))
        eng.step()
        if step >= 10 and all(r.id != big for r in eng.waiting):
            return step - 10
    raise AssertionError("never admitted")


def test_a_big_request_is_not_starved_by_a_stream_of_small_ones(model):
    """Admitting any waiting request that fits kept the big one waiting until the stream stopped (33 steps
    of a 40-step stream, 293 of a 300-step one); in arrival order it waits for the short requests ahead of
    it to finish, at most their 6 new tokens, however long the stream."""
    assert big_request_wait(model, 40) <= 6


def test_abort_waiting_and_running_requests(model):
    eng = Engine(model, num_blocks=8, block_size=16)
    keep = eng.add(PROMPTS[0], SamplingParams(max_new_tokens=10))
    running = eng.add(PROMPTS[1], SamplingParams(max_new_tokens=10))   # 2 blocks
    waiting = eng.add(list(range(100)), SamplingParams(max_new_tokens=10))  # 7 blocks: waits
    eng.step()
    eng.step()
    free = eng.cache.manager.available
    assert eng.abort(waiting) and [r.id for r in eng.waiting] == []
    assert eng.abort(running) and eng.cache.manager.available == free + 2
    assert eng.finished[waiting].error == "aborted" and eng.finished[running].error == "aborted"
    assert len(eng.finished[running].output) == 2 and [r.id for r in eng.running] == [keep]
    assert not eng.abort(running) and not eng.abort(12345)  # finished, unknown
    run_out(eng)
    assert eng.finished[keep].output == solo(model, PROMPTS[0], 10) and all_free(eng)


def test_abort_inside_a_pending_chained_step(model):
    """A request of a step still in flight keeps its blocks until the step is read (its replay may still
    write them); the next `step` retires it, with no token of that step, and the others go on unchanged."""
    eng = Engine(model, num_blocks=16)
    eng.graphs = EagerGraphs(model, eng.cache)
    ids = [eng.add(p, SamplingParams(max_new_tokens=12)) for p in PROMPTS]
    for _ in range(4):
        eng.step()
    assert eng.pending is not None and eng.graphs.chained >= 1
    victim = ids[1]
    blocks, n_out = list(eng.cache.manager.tables[victim]), len(next(r for r in eng.running if r.id == victim).output)
    assert eng.abort(victim)
    assert eng.cache.manager.tables[victim] == blocks and victim not in eng.finished  # marked only
    eng.step()
    req = eng.finished[victim]
    assert req.error == "aborted" and len(req.output) == n_out and victim not in eng.cache.manager.tables
    run_out(eng)
    assert [eng.finished[i].output for i in (ids[0], ids[2])] == [solo(model, PROMPTS[0], 12), solo(model, PROMPTS[2], 12)]
    assert all_free(eng)


def test_finished_requests_are_handed_over_not_kept(model):
    eng = Engine(model, num_blocks=16)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=3))
    assert [len(r.output) for r in outs] == [3, 3, 3] and not eng.finished   # generate takes its own
    short = eng.add(PROMPTS[0], SamplingParams(max_new_tokens=2))
    long = eng.add(PROMPTS[1], SamplingParams(max_new_tokens=4))
    refused = eng.add([3] * 1020, SamplingParams(max_new_tokens=8))
    run_out(eng)
    assert [r.id for r in eng.pop_finished()] == [refused, short, long]      # in the order they finished
    assert eng.pop_finished() == [] and not eng.finished


def poison(monkeypatch, model: Decoder, seq: int, call: int, value: float) -> None:
    """Make `model`'s forward number `call` (0: the next) put `value` in the logits of sequence `seq`
    (NaN: the whole row; inf: one entry), as a model overflowing on that sequence would."""
    forward, calls = model.forward, iter(range(1 << 30))

    def poisoned(batch, cache, **kw):
        logits = forward(batch, cache, **kw)
        if next(calls) == call and seq in batch.seqs:
            logits = logits.clone()
            logits[batch.seqs.index(seq), 5 if math.isinf(value) else slice(None)] = value
        return logits
    monkeypatch.setattr(model, "forward", poisoned)


@pytest.mark.parametrize("value, temperature", [(math.nan, 0.0), (math.inf, 0.0), (math.nan, 0.8), (math.inf, 0.8)])
def test_non_finite_logits_fail_their_request_alone(model, monkeypatch, value, temperature):
    """Greedy read a row of NaNs as token 0 and a row with an inf as that token, and sampling failed with
    torch's message: the request fails naming the step, its tokens so far kept, and the requests batched
    with it give their solo outputs."""
    want = [solo(model, p, 6) for p in (PROMPTS[0], PROMPTS[2])]
    eng = Engine(model, num_blocks=16)
    ids = [eng.add(p, SamplingParams(max_new_tokens=6)) for p in (PROMPTS[0], PROMPTS[2])]
    bad = eng.add(PROMPTS[1], SamplingParams(max_new_tokens=6, temperature=temperature, seed=2))
    poison(monkeypatch, model, bad, call=2, value=value)  # (call 0 is the prefill: step 2 of every request)
    run_out(eng)
    assert eng.finished[bad].error == "the logits at step 2 (new token 3) are NaN or inf"
    assert len(eng.finished[bad].output) == 2
    assert [eng.finished[i].output for i in ids] == want and not any(eng.finished[i].error for i in ids)
    assert all_free(eng)


def test_a_minus_inf_logit_is_a_token_never_drawn(model, monkeypatch):
    """-inf is a logit of probability 0 (a masked token), not a fault: the request goes on as it would."""
    want = solo(model, PROMPTS[1], 6)
    eng = Engine(model, num_blocks=16)
    rid = eng.add(PROMPTS[1], SamplingParams(max_new_tokens=6))
    poison(monkeypatch, model, rid, call=2, value=-math.inf)
    run_out(eng)
    assert not eng.finished[rid].error and eng.finished[rid].output == want


def test_non_finite_logits_in_a_chained_step_fail_their_request(model, monkeypatch):
    """A chained step's tokens reach the host without its logits: the mark travels with them."""
    want = [solo(model, p, 10) for p in (PROMPTS[0], PROMPTS[2])]
    eng = Engine(model, num_blocks=16)
    eng.graphs = EagerGraphs(model, eng.cache)
    ids = [eng.add(p, SamplingParams(max_new_tokens=10)) for p in (PROMPTS[0], PROMPTS[2])]
    bad = eng.add(PROMPTS[1], SamplingParams(max_new_tokens=10))
    poison(monkeypatch, model, bad, call=4, value=math.nan)  # a replay with tokens=None (call 1 is the first replay)
    run_out(eng)
    assert eng.graphs.chained >= 3
    assert eng.finished[bad].error == "the logits at step 4 (new token 5) are NaN or inf"
    assert len(eng.finished[bad].output) == 4
    assert [eng.finished[i].output for i in ids] == want and not any(eng.finished[i].error for i in ids)
    assert all_free(eng)
