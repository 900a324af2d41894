"""Garbage outside a sequence's own positions, for the checks that it never reaches its attention
(tests/test_kv_garbage.py on the CPU, tests/test_gpu.py on the device): NaN or inf in every cache
slot before a ragged engine run, or outside the sequences' positions of an attention kernel's inputs,
against the same with zeros there."""
from __future__ import annotations

import math
from typing import Callable

import torch

from flashgen.check import tolerance
from flashgen.runtime.decoder.engine import Engine

# (prompt length, new tokens) of the requests joining at each step: lengths of one token, under, at and
from flashgen.runtime.decoder.sampling import SamplingParams

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


def own_tables(lens: list[int], bs: int, nb: int, maxb: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables of contexts `lens` over distinct blocks, none of them block 0 (where the entries of a
    padded table point), padded with 0 to `maxb` entries; and which cache slots [nb, bs] hold a context."""
    free = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    rows, own = [], torch.zeros(nb, bs, dtype=torch.bool)
    for n in lens:
        k = -(-n // bs)
        blocks, free = free[:k], free[k:]
        rows.append(blocks + [0] * (maxb - k))
        for p in range(n):
            own[blocks[p // bs], p % bs] = True
    return torch.tensor(rows, dtype=torch.int32), own


def packed(wl, g: torch.Generator, lens: list[int], pad: int) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor]:
    """Inputs of a packed batch of three sequences `lens` and `pad` rows after them (the workload's T
    rows); which rows stay clean in q, k and v (not the middle sequence's, not the padding); and the
    rows compared, the other two sequences'."""
    assert len(lens) == 3 and sum(lens) + pad == wl.dim["T"]
    ins = wl.op.make_inputs(wl.dim, wl.attr, g)
    ins["cu_seqlens"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    cu = ins["cu_seqlens"].tolist()
    good = torch.zeros(wl.dim["T"], dtype=torch.bool)
    good[:cu[1]] = good[cu[2]:cu[3]] = True
    return ins, {"q": good, "k": good, "v": good}, good


def outside(x: torch.Tensor, keep: torch.Tensor, fill: float) -> torch.Tensor:
    """`x` with `fill` wherever `keep` (broadcast over x's trailing dims) is False."""
    keep = keep.reshape(*keep.shape, *[1] * (x.dim() - keep.dim()))
    if x.dtype == torch.float8_e4m3fn:  # e4m3 has no inf (NaN is 0x7f), and torch.where no fp8
        return torch.where(keep, x.view(torch.uint8), 0 if fill == 0 else 0x7F).view(torch.float8_e4m3fn)
    return torch.where(keep, x, torch.tensor(fill, dtype=x.dtype))


def check_both(wl, run: Callable[[dict], torch.Tensor], ins: dict, keep: dict[str, torch.Tensor], fill: float,
               rows: torch.Tensor | None = None, params: dict | None = None) -> None:
    """`run(inputs)`, a kernel's output on the CPU, with `fill` outside `keep` in each named input equals
    its output with zeros there, on the rows `rows` (all if None), and matches the float64 reference
    of the garbage inputs there."""
    clean = run({**ins, **{n: outside(ins[n], k, 0.0) for n, k in keep.items()}})
    dirty_ins = {**ins, **{n: outside(ins[n], k, fill) for n, k in keep.items()}}
    dirty = run(dirty_ins)
    want = wl.op.reference(dirty_ins, {**wl.op.params, **(params or {})}, wl.dim, wl.attr)["out"]
    if rows is not None:
        clean, dirty, want = clean[rows], dirty[rows], want[rows]
    assert torch.isfinite(want).all() and torch.isfinite(clean.double()).all()
    err = (clean.double() - want).norm() / want.norm()
    assert err <= tolerance(wl, wl.attr["dtype"]), err
    assert torch.equal(dirty, clean), (dirty.double() - clean.double()).abs().max()
