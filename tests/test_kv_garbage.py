"""Values outside a sequence's own positions never change its attention: whatever a KV-cache slot holds
past a context (the rest of its last block, a block a padded table names, blocks another request left
behind) or a packed batch holds past a sequence (the next sequence's keys and values, padding) is
masked out by selection, so NaN or inf there cannot reach the output through 0 x NaN. On the CPU the
decoder's torch attention."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from flashgen.runtime.bench import CONFIGS, random_weights
from flashgen.runtime.engine import Engine
from flashgen.runtime.model import Decoder
from tests.eager_graphs import EagerGraphs
from tests.garbage import check_ragged_runs

FILLS = [math.nan, math.inf]


@pytest.fixture(scope="module", params=[None, 8], ids=["full", "window8"])
def model(request) -> Decoder:
    c = replace(CONFIGS["tiny"], sliding_window=request.param)
    return Decoder(c, random_weights(c, torch.float32, torch.device("cpu"), seed=3))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "chained"])
@pytest.mark.parametrize("fill", FILLS, ids=["nan", "inf"])
def test_garbage_in_the_cache_changes_no_token(model, fill, graphs):
    """A cache whose every slot holds NaN (or +inf) before any request gives the tokens of a clean one:
    ragged prefills, decode steps over the view and the gather of block tables, mixed steps, blocks
    reused, with and without chained steps (the CPU stand-in for CUDA graphs)."""
    def make_engine() -> Engine:
        eng = Engine(model, num_blocks=10, block_size=16)
        if graphs:
            eng.graphs = EagerGraphs(model, eng.cache)
        return eng

    eng = check_ragged_runs(make_engine, fill)
    assert not graphs or eng.graphs.chained > 0
