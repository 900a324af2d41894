"""Automatic prefix caching (runtime/decoder/kv_cache.py, runtime/decoder/engine.py) on the CPU, tiny random
Llama: requests sharing prefixes get the tokens of an engine without the cache, greedy or sampled; the
blocks they share are full and written before anyone else reads them; eviction takes the least recently
used idle blocks; aborted and failed requests leak no block, and no block is counted as held by fewer
tables than hold it, at any step."""
from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from flashgen.runtime.decoder.bench import CONFIGS, random_weights
from flashgen.runtime.decoder.engine import Engine, Request
from flashgen.runtime.decoder.kv_cache import BlockManager, block_keys
from flashgen.runtime.decoder.model import Decoder
from flashgen.runtime.decoder.sampling import SamplingParams
from tests.eager_graphs import EagerGraphs

BS = 16  # the engine's block size


@pytest.fixture(scope="module")
def model() -> Decoder:
    c = CONFIGS["tiny"]  # vocab 256, no EOS: every request runs to its length
    return Decoder(c, random_weights(c, torch.float32, torch.device("cpu"), seed=3))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_blocks(m: BlockManager) -> None:
    """Every block is held (by as many tables as its count says, at least one), idle in the cache, or
    free, exactly one of these; every idle one is published under its key."""
    held = Counter(b for t in m.tables.values() for b in t)
    assert dict(held) == m.refs and all(n >= 1 for n in m.refs.values())
    assert sorted(m.free + list(m.cached) + list(held)) == list(range(m.num_blocks))
    assert all(m.key_of.get(b) == k and m.block_of[k] == b for b, k in m.cached.items())
    assert all(m.block_of[k] == b for b, k in m.key_of.items())


def nothing_held(m: BlockManager) -> bool:
    return not m.tables and not m.refs and sorted(m.free + list(m.cached)) == list(range(m.num_blocks))


def serve(eng: Engine, joins: dict[int, list[tuple[list[int], SamplingParams]]]) -> list[Request]:
    """Each request of `joins` added at its step; every step's blocks checked, and the context the block
    tables are sized for (idle cached blocks are still the cache's); the requests in order."""
    rids, step = [], 0
    width = eng.model.table_width(eng.cache)
    while step <= max(joins) or eng.waiting or eng.running or eng.pending:
        rids += [eng.add(p, params) for p, params in joins.get(step, [])]
        eng.step()
        check_blocks(eng.cache.manager)
        assert eng.model.table_width(eng.cache) == width
        step += 1
    return [eng.finished.pop(i) for i in rids]


def joins_of(system: list[int], sampled: bool) -> dict[int, list[tuple[list[int], SamplingParams]]]:
    """Requests sharing the prompt `system`: one alone, one joining it in its first step, three while it
    decodes (one prompt is `system` itself), its own prompt again and a follow-up of its whole
    conversation after it ends. Sampled: each with its own seed."""
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=6, temperature=0.9, top_p=0.95, seed=i) if sampled else \
            SamplingParams(max_new_tokens=6)
    first = system + ids(10, 1)
    return {0: [(first, params(0)), (system + ids(11, 2), params(1))],
            2: [(system, params(2)), (system + ids(20, 3), params(3)), (ids(30, 4), params(4))],
            7: [(first, params(5))]}


def follow_up(first: Request) -> list[int]:
    return first.prompt + first.output + ids(9, 6)


# system prompt length: under a block, exactly two, two and a tail; the tokens each request takes from
# the cache (the follow-up last: the blocks its first turn wrote, output included)
@pytest.mark.parametrize("length, cached", [(5, [0, 0, 0, 0, 0, 0, 16]),
                                            (32, [0, 32, 16, 32, 0, 32, 32]),
                                            (37, [0, 32, 32, 32, 0, 32, 48])])
def test_tokens_are_those_of_an_engine_without_the_cache(model, length, cached):
    """The cached prefixes end at full blocks of what earlier requests computed, and at the prompt's last
    token at the latest (`system` alone, 32 tokens, takes one block); the second request, joining the
    first's step, waits one step to share its blocks rather than computing them beside it."""
    system = ids(length, 0)
    runs = {}
    for on in (False, True):
        eng = Engine(model, num_blocks=64, prefix_cache=on)
        reqs = serve(eng, joins_of(system, sampled=False))
        reqs += serve(eng, {0: [(follow_up(reqs[0]), SamplingParams(max_new_tokens=3))]})
        assert all(r.error == "" and len(r.output) == r.params.max_new_tokens for r in reqs)
        assert nothing_held(eng.cache.manager)
        runs[on] = reqs
    assert [r.output for r in runs[True]] == [r.output for r in runs[False]]
    assert [r.cached_tokens for r in runs[True]] == cached and {r.cached_tokens for r in runs[False]} == {0}


def test_sampled_requests_with_seeds_are_those_of_an_engine_without_the_cache(model):
    system = ids(37, 0)
    outs = {on: [r.output for r in serve(Engine(model, num_blocks=64, prefix_cache=on), joins_of(system, sampled=True))]
            for on in (False, True)}
    assert outs[True] == outs[False] and len(set(map(tuple, outs[True]))) == len(outs[True])


def test_a_block_is_shared_only_once_written(model):
    """Two requests of one prompt added together: the second waits a step, then shares the three blocks
    the first computed (each held twice); never a block whose keys and values are still to come, even
    with every token of it known: a decoding request's block is shared only after the step that
    computes its last token's key and value."""
    eng = Engine(model, num_blocks=64)
    m = eng.cache.manager
    prompt = ids(50, 7)  # three full blocks before its last token
    a, b = (eng.add(prompt, SamplingParams(max_new_tokens=20)) for _ in range(2))
    eng.step()
    assert [r.id for r in eng.running] == [a] and [r.id for r in eng.waiting] == [b]
    assert set(m.tables[a]) & set(m.key_of) == set(m.tables[a][:3])  # its three full blocks published, no more
    eng.step()
    ra, rb = sorted(eng.running, key=lambda r: r.id)
    assert rb.cached_tokens == 48 and m.tables[b][:3] == m.tables[a][:3] and m.tables[b][3] != m.tables[a][3]
    assert [m.refs[x] for x in m.tables[a][:4]] == [2, 2, 2, 1]
    while len(ra.tokens) < 64:  # a's fourth block holds 64 known tokens, the last one's key and value not computed
        eng.step()
    assert len(ra.tokens) == 64
    c = eng.add(ra.tokens + [1], SamplingParams(max_new_tokens=2))
    eng.step()
    assert next(r for r in eng.running if r.id == c).cached_tokens == 48
    c_block = m.tables[c][3]  # its own copy of a's fourth block, computed in this step
    d = eng.add(ra.tokens[:64] + [1], SamplingParams(max_new_tokens=2))  # (the step computed it: a's and c's)
    eng.step()
    assert next(r for r in eng.running if r.id == d).cached_tokens == 64
    assert m.tables[d][:3] == m.tables[a][:3] and m.tables[d][3] in (m.tables[a][3], c_block)
    while eng.running:
        eng.step()
        check_blocks(m)
    alone = Engine(model, num_blocks=64, prefix_cache=False)
    short = SamplingParams(max_new_tokens=2)
    assert eng.finished[a].output == eng.finished[b].output == \
        alone.generate([prompt], SamplingParams(max_new_tokens=20))[0].output
    assert [eng.finished[i].output for i in (c, d)] == \
        [r.output for r in alone.generate([ra.tokens[:64] + [1], ra.tokens[:64] + [1]], short)]
    assert nothing_held(m)


def test_eviction_takes_the_least_recently_used_idle_blocks(model):
    """An 8-block cache: A's and B's prompt blocks stay idle; A runs again (its blocks used last); C needs
    six blocks while four are free, is admitted (idle blocks count), and evicts B's, not A's. Tokens as
    without the cache, throughout."""
    A, B, C = ids(40, 11), ids(40, 12), ids(80, 13)
    order = [A, B, A, C, A, B]
    outs = {}
    for on in (False, True):
        eng = Engine(model, num_blocks=8, prefix_cache=on)
        reqs = [serve(eng, {0: [(p, SamplingParams(max_new_tokens=n))]})[0] for p, n in zip(order, (8, 8, 8, 16, 4, 4))]
        outs[on] = [(r.error, r.output) for r in reqs]
        if on:
            assert [r.cached_tokens for r in reqs] == [0, 0, 32, 0, 32, 0]
            assert nothing_held(eng.cache.manager)
    assert outs[True] == outs[False] and all(e == "" for e, _ in outs[True])


def test_aborted_and_failed_requests_leak_no_block(model, monkeypatch):
    """Chained steps (CPU stand-ins for CUDA graphs) over shared prefixes: a waiting request aborted, a
    running one aborted inside a pending step, a forward that fails its whole step: every block ends free
    or idle, and what stayed cached gives the same prompts their tokens without the cache."""
    system = ids(40, 20)
    prompts = [system + ids(n, 21 + n) for n in (3, 9, 14)]
    eng = Engine(model, num_blocks=64)
    eng.graphs = EagerGraphs(model, eng.cache)
    m = eng.cache.manager
    rids = [eng.add(p, SamplingParams(max_new_tokens=12)) for p in prompts]
    for _ in range(4):
        eng.step()
        check_blocks(m)
    assert eng.pending is not None and len(m.refs) < sum(map(len, m.tables.values()))  # pending, sharing
    waiting = eng.add(ids(300, 30), SamplingParams(max_new_tokens=4))  # more blocks than are available
    assert eng.abort(waiting) and eng.abort(rids[1])
    eng.step()
    check_blocks(m)
    assert eng.finished[rids[1]].error == "aborted" and rids[1] not in m.tables
    forward = model.forward

    def failing(*args, **kwargs):
        raise RuntimeError("device lost")

    late = eng.add(system + ids(6, 31), SamplingParams(max_new_tokens=5))  # a prefill: the forward runs
    monkeypatch.setattr(model, "forward", failing)
    eng.step()
    assert eng.finished[late].error == "step failed: RuntimeError: device lost"
    assert all(eng.finished[i].error.startswith("step failed") for i in (rids[0], rids[2]))
    monkeypatch.setattr(model, "forward", forward)
    assert not eng.running and eng.pending is None and nothing_held(m) and m.cached
    again = list(serve(eng, {0: [(p, SamplingParams(max_new_tokens=6)) for p in prompts]}))
    # (the second and third computed their third block before they ended: aborted, failed)
    assert [r.cached_tokens for r in again] == [32, 48, 48] and nothing_held(m)
    want = Engine(model, num_blocks=64, prefix_cache=False).generate(prompts, SamplingParams(max_new_tokens=6))
    assert [r.output for r in again] == [r.output for r in want]


def test_block_counts_never_go_negative():
    """Blocks held by several tables are counted per table and idle only when the last lets go; a
    sequence released twice or never reserved changes nothing."""
    m = BlockManager(6, 4)
    tokens = list(range(10))
    m.reserve(0, 10)
    m.publish(0, tokens, 9)  # two full blocks of written tokens
    keys = block_keys(tokens[:9], 4)
    prefix = m.cached_prefix(keys)
    assert prefix == m.tables[0][:2] and not m.can_hold(1, 24, prefix) and m.can_hold(1, 20, prefix)
    m.reserve(1, 12, prefix, keys)
    assert [m.refs[b] for b in prefix] == [2, 2] and m.tables[1][:2] == prefix
    m.release(0)
    assert [m.refs[b] for b in prefix] == [1, 1] and not m.cached
    check_blocks(m)
    m.release(1)
    m.release(1)
    m.release(7)
    check_blocks(m)
    assert not m.refs and list(m.cached) == prefix[::-1] and len(m.free) == 4  # the prefix's tail evicted first
    assert m.cached_prefix(keys) == prefix
    m.reserve(2, 24)  # every block: the idle ones evicted, their keys forgotten
    assert m.cached_prefix(keys) == [] and not m.cached and not m.key_of
    check_blocks(m)


def bench_module():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import prefix_cache
    return prefix_cache


def test_the_benchmark_serves_both_engines_side_by_side(tmp_path, capsys):
    """benchmarks/prefix_cache.py on the tiny config: without the cache every prompt prefills in the first
    step; with it the first request computes the system prompt's two full blocks and the 14 others wait
    that step and share them. The metrics and ratios follow from the recorded times."""
    prefix_cache = bench_module()
    argv = ["--device", "cpu", "--requests", "15", "--system-len", "40", "--user-len", "3-9", "--output-len", "3",
            "--out-dir", str(tmp_path), "--name", "pc"]
    assert prefix_cache.main(argv) == 0
    data = json.loads((tmp_path / "pc.json").read_text())
    assert data["columns"] == list(prefix_cache.HEADER) and data["meta"]["device"] == "cpu"
    rows = [dict(zip(data["columns"], r)) for r in data["rows"]]
    assert [(r["prefix_cache"], r["cached_prompt_tokens"], r["output_tokens"]) for r in rows] == \
        [(False, 0, 45), (True, 14 * 32, 45)]
    events = {on: data["meta"]["requests"]["prefix cache" if on else "no cache"] for on in (False, True)}
    assert len({e[2] for e in events[False]}) == 1  # one step's first tokens
    assert all(e[2] > events[True][0][2] for e in events[True][1:]) and [e[5] for e in events[True]] == [0] + [32] * 14
    for r, on in zip(rows, (False, True)):
        ttft = [1e3 * (e[2] - e[0]) for e in events[on]]
        assert r["ttft_first_ms"] == pytest.approx(ttft[0])
        assert r["ttft_later_median_ms"] == pytest.approx(statistics.median(ttft[1:]))
        assert r["throughput_tok_s"] == pytest.approx(45 / max(e[3] for e in events[on]))
    ratios = data["meta"]["ratios"]
    assert ratios["same_tokens"] == 1.0
    assert ratios["throughput"] == pytest.approx(rows[1]["throughput_tok_s"] / rows[0]["throughput_tok_s"])
    assert ratios["ttft_later_p90"] == pytest.approx(rows[0]["ttft_later_p90_ms"] / rows[1]["ttft_later_p90_ms"])
    assert "throughput" in capsys.readouterr().out and "| True | 15 |" in (tmp_path / "pc.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--user-len", "9-3"], "--user-len must be 1 <= LO <= HI, got '9-3'"),
    (["--user-len", "x"], "--user-len takes N or LO-HI, got 'x'"),
    (["--rate", "-1"], "--rate must be 0 (together) or positive requests/s, got -1.0"),
    (["--requests", "0"], "--requests must be at least 1, got 0"),
    (["--config", "gpt5"], "unknown config 'gpt5'"),
])
def test_the_benchmark_refuses_bad_settings_in_one_line(tmp_path, capsys, args, message):
    assert bench_module().main(["--device", "cpu", "--out-dir", str(tmp_path)] + args) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("prefix_cache.py: ") and err.count("\n") == 1
    assert not list(tmp_path.iterdir())
