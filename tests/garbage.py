"""Garbage outside a sequence's own positions, for the checks that it never reaches its attention
(tests/test_kv_garbage.py): NaN or inf in every cache slot before a ragged engine run, against the
same run on a clean cache."""
from __future__ import annotations

import math
from typing import Callable

import torch

from flashgen.runtime.engine import Engine, SamplingParams

# (prompt length, new tokens) of the requests joining at each step: lengths of one token, under, at and
# over a block of 16; 10 blocks hold only some of them at once, so later ones reuse freed blocks
JOINS = {0: [(5, 6), (20, 12), (1, 9), (33, 4)], 3: [(16, 7), (47, 5)], 6: [(31, 10), (2, 8)]}


def ragged_run(eng: Engine, fill: float | None) -> list[tuple[str, list[int]]]:
    """Each request's (error, tokens) of a run of JOINS on `eng`, every layer's cache filled with `fill`
    first (None: the zeros a cache starts with)."""
    if fill is not None:
        for t in eng.cache.k + eng.cache.v:
            t.fill_(fill)
    g = torch.Generator().manual_seed(11)
    ids, step = [], 0
    while step <= max(JOINS) or eng.waiting or eng.running or eng.pending:
        for n, new in JOINS.get(step, []):
            ids.append(eng.add(torch.randint(0, 256, (n,), generator=g).tolist(), SamplingParams(max_new_tokens=new)))
        eng.step()
        step += 1
    return [(eng.finished[i].error, eng.finished[i].output) for i in ids]


def check_ragged_runs(make_engine: Callable[[], Engine], fill: float) -> Engine:
    """A run of JOINS on a cache full of `fill` gives every request the tokens of a clean one, and
    leaves the garbage in the slots no request wrote (so it was there to be read); returns the
    dirty run's engine. (The model must have no EOS: every request runs to its length.)"""
    clean = ragged_run(make_engine(), None)
    eng = make_engine()
    dirty = ragged_run(eng, fill)
    assert [(e, len(o)) for e, o in clean] == [("", n) for j in JOINS.values() for _, n in j]
    assert dirty == clean
    assert all((torch.isnan(t) if math.isnan(fill) else torch.isinf(t)).any() for t in eng.cache.k + eng.cache.v)
    return eng
