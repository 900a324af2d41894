"""Values outside a sequence's own positions never change its attention: whatever a KV-cache slot holds
past a context (the rest of its last block, a block a padded table names, blocks another request left
behind) or a packed batch holds past a sequence (the next sequence's keys and values, padding) is
masked out by selection, so NaN or inf there cannot reach the output through 0 x NaN. On the CPU the
decoder's torch attention, in Triton's interpreter the generated kernels (fp16: bf16 dots are wrong
there); the GPU's in tests/test_gpu.py."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import flashgen
from flashgen.runtime.decoder.bench import CONFIGS, random_weights
from flashgen.runtime.decoder.engine import Engine
from flashgen.runtime.decoder.model import Decoder
from tests.eager_graphs import EagerGraphs
from tests.garbage import check_both, check_ragged_runs, own_tables, packed

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


# ---- generated kernels in Triton's interpreter ----------------------------------------------------
def interpreted(interpreter, wl, s, params: dict | None = None):
    return lambda ins: interpreter.run(wl, s, "h200", ins, params)["out"]


DECODE = {"pages": 2, "num_warps": 4, "num_stages": 2, "splits": 1}


@pytest.mark.parametrize("fill", FILLS, ids=["nan", "inf"])
@pytest.mark.parametrize("d, kv, mod, s", [
    (32, "same", "none", DECODE),
    (32, "same", "window", {**DECODE, "pages": 1, "splits": 4, "early_kv": 1}),
    (80, "same", "none", {**DECODE, "splits": 2}),
    (32, "fp8e4m3", "none", {**DECODE, "splits": 2, "early_kv": 1}),
], ids=["plain", "split-early-window", "padded-d", "fp8"])
def test_decode_reads_only_its_context(interpreter, fill, d, kv, mod, s):
    """Contexts of 37, 16 and 1 tokens (past a block, a whole one, one token) in tables padded with
    block 0: the cache's every other slot holds the garbage."""
    if kv == "fp8e4m3" and math.isinf(fill):
        pytest.skip("e4m3 has no inf")
    lens, bs, nb, maxb = [37, 16, 1], 16, 12, 4
    wl = flashgen.workload("paged_decode_attention", B=3, Hq=4, Hkv=2, D=d, BS=bs, NB=nb, MAXB=maxb, L=64,
                           dtype="fp16", kv=kv, mod=mod)
    g = torch.Generator().manual_seed(d)
    ins = wl.op.make_inputs(wl.dim, wl.attr, g)
    ins["block_tables"], own = own_tables(lens, bs, nb, maxb, g)
    ins["context_lens"] = torch.tensor(lens, dtype=torch.int32)
    params = {"window": 20.0} if mod == "window" else {"k_scale": 0.5, "v_scale": 2.0} if kv != "same" else None
    check_both(wl, interpreted(interpreter, wl, s, params), ins, {"k_cache": own, "v_cache": own}, fill, params=params)


PACKED = {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1}
LENS, PAD = [13, 40, 7], 5  # the middle sequence's rows and the padding hold the garbage


@pytest.mark.parametrize("fill", FILLS, ids=["nan", "inf"])
@pytest.mark.parametrize("d, s", [(32, PACKED), (32, {**PACKED, "tma": 1}), (80, {**PACKED, "tma": 1}),
                                  (32, {**PACKED, "block_m": 64, "tma": 1})], ids=["plain", "tma", "tma-padded-d", "tma-64"])
def test_packed_prefill_reads_only_its_sequence(interpreter, fill, d, s):
    """Tiles reaching past a sequence read the next one's keys and values (or the padding past the
    last): a neighbour's garbage changes none of the other sequences' outputs."""
    wl = flashgen.workload("flash_prefill_attention", T=sum(LENS) + PAD, B=3, Hq=4, Hkv=2, D=d, dtype="fp16")
    ins, keep, rows = packed(wl, torch.Generator().manual_seed(d), LENS, PAD)
    check_both(wl, interpreted(interpreter, wl, s), ins, keep, fill, rows)


@pytest.mark.parametrize("fill", FILLS, ids=["nan", "inf"])
@pytest.mark.parametrize("s", [PACKED, {**PACKED, "tma": 1}], ids=["plain", "tma"])
def test_chunked_prefill_reads_only_its_prefix_and_sequence(interpreter, fill, s):
    """Prefixes of 20, 0 and 35 cached tokens in tables padded with block 0, the cache's other slots
    garbage; and garbage new tokens in the middle sequence and the padding, as in packed prefill."""
    bs, nb, maxb, prefixes = 16, 12, 3, [20, 0, 35]
    wl = flashgen.workload("chunked_prefill_attention", T=sum(LENS) + PAD, B=3, Hq=4, Hkv=2, D=32, BS=bs, NB=nb,
                           MAXB=maxb, dtype="fp16")
    g = torch.Generator().manual_seed(4)
    ins, keep, rows = packed(wl, g, LENS, PAD)
    ins["block_tables"], own = own_tables(prefixes, bs, nb, maxb, g)
    ins["prefix_lens"] = torch.tensor(prefixes, dtype=torch.int32)
    check_both(wl, interpreted(interpreter, wl, s), ins, {**keep, "k_cache": own, "v_cache": own}, fill, rows)


@pytest.mark.parametrize("consumers, pingpong, block_n", [(2, 1, 64), (1, 0, 128)])
def test_gluon_prefill_zeroes_values_past_the_sequence(consumers, pingpong, block_n):
    """The Gluon prefill (its numerics run on the GPU only: tests/test_gpu.py) copies whole value rows by
    TMA: before a query tile's last values MMA, the rows of its last key tile past the sequence are
    zeroed in the ring slot and fenced for the MMA; the sm_90 build keeps its MMAs."""
    from flashgen.schedules.space import ScheduleSpace
    from flashgen.targets import get_target
    wl = flashgen.workload("flash_prefill_attention", T=1000, B=3, Hq=32, Hkv=8, D=128, dtype="bf16")
    s = {"block_m": 64 * consumers, "block_n": block_n, "num_warps": 4, "num_stages": 2, "tma": 0, "backend": 1,
         "consumers": consumers, "pingpong": pingpong, "persistent": 0}
    assert ScheduleSpace(wl, get_target("sm_90")).why_invalid(s) is None
    k = flashgen.compile(wl, "sm_90", schedule=s)
    src = k.source
    zero = src.index("v_last.store(gl.where(v_row < n, v_last.load(v_layout), 0.0))")
    assert src.index("if n_tiles * BLOCK_N > n:") < zero < src.index("fence_async_shared()", zero) \
        < src.index("acc = warpgroup_mma(pa, v_ring.index(last)", zero)
    per = 2 * 128 // 16 + 2 * block_n // 16  # the MMAs test_gluon.py counts: no more
    assert k.binary[:4] == b"\x7fELF" and k.asm["ptx"].count("wgmma.mma_async") == consumers * per
