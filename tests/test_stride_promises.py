"""What a Triton binary is promised about its strides holds for every call dispatch sends it: one
binary serves every row count of its workload, so a stride that a row dim enters (a block table's width)
is never promised divisible, and the promises are part of the artifact cache's key."""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from flashgen.targets.triton import cache_key
from flashgen.targets.triton.build import stride_hints
from flashgen.targets.triton.codegen import generate
from flashgen.targets.triton.launch import TritonLauncher

TARGET = get_target("h100")
DIMS = {"chunked_prefill_attention": dict(T=40, B=3, Hq=4, Hkv=2, D=64, BS=16, NB=70, MAXB=64),
        "paged_decode_attention": dict(B=3, Hq=4, Hkv=2, D=64, BS=16, NB=70, MAXB=64, L=1024)}


@pytest.mark.parametrize("op", sorted(DIMS))
def test_a_binary_built_at_one_table_width_serves_another(op):
    """Built for tables 64 blocks wide (a multiple of 16), the launcher takes a call whose tables are 63
    wide, as a cache of another size gives them; before, it refused the call (the binary assumed the
    row stride divisible by 16), failing every request of the step."""
    wl = flashgen.workload(op, **DIMS[op], dtype="bf16")
    ks = generate(wl, ScheduleSpace(wl, TARGET).default())
    hints = stride_hints(ks, wl)
    assert hints["block_tables_s0"] is False and hints["k_cache_s0"] and hints["q_s0"]
    call = wl.with_dims(MAXB=63, NB=63, **({"L": 63 * 16} if "L" in wl.dim else {}))
    tensors = {t.name: torch.zeros(call.shape(t.name), dtype=torch.int32 if t.name == "block_tables" else torch.bfloat16)
               for t in wl.op.inputs + wl.op.outputs if t.name in {a.tensor for a in ks.args}}
    args = TritonLauncher(ks, wl, TARGET).args(tensors, wl.op.params, call.dim)
    names = [a.name for a in ks.args]
    assert args[names.index("block_tables_s0")] == 63


def test_the_stride_promises_are_part_of_the_cache_key(monkeypatch):
    """Two workloads of one source whose strides are promised differently get two artifact entries: a
    binary that relies on a promise is never loaded for a workload that does not keep it."""
    import flashgen.targets.triton as triton_backend
    wl = flashgen.workload("rmsnorm", M=4, N=64, dtype="bf16")
    schedule = ScheduleSpace(wl, TARGET).default()
    ks = generate(wl, schedule)
    hints = stride_hints(ks, wl)
    assert hints and all(hints.values())
    key = cache_key(ks, wl, schedule, TARGET)
    monkeypatch.setattr(triton_backend, "stride_hints", lambda ks, wl: {name: False for name in hints})
    assert cache_key(ks, wl, schedule, TARGET) != key
