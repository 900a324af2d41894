"""Index inputs outside their tensors: no kernel reads or writes out of bounds for any of them.

The caches are views into larger buffers with a guard row on each side, so that a write one slot
before or after the cache lands in a guard row this test sees, rather than in someone else's memory.
"""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.oplib.rope import cos_sin_cache
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target

M, HQ, HKV, D, L, NS = 6, 3, 2, 34, 13, 11
# slot -1 (padding) mid-batch, one slot past the cache, one position past the cos/sin table
SLOTS = [4, -1, 10, NS, 0, 7]
POSITIONS = [3, 12, 0, 5, L, 9]


def _case(style: str, seed: int) -> tuple[flashgen.Workload, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The workload, its inputs (caches as views between guard rows) and the backing buffers."""
    wl = flashgen.workload("rope_cache", M=M, Hq=HQ, Hkv=HKV, D=D, L=L, NS=NS, style=style, dtype="fp32")
    g = torch.Generator().manual_seed(seed)
    backing = {n: torch.randn(NS + 2, HKV, D, generator=g) for n in ("k_cache", "v_cache")}
    inputs = {"q": torch.randn(M, HQ, D, generator=g), "k": torch.randn(M, HKV, D, generator=g),
              "positions": torch.tensor(POSITIONS), "cos_sin": cos_sin_cache(L, D),
              "v": torch.randn(M, HKV, D, generator=g), "slots": torch.tensor(SLOTS),
              **{n: b[1:NS + 1] for n, b in backing.items()}}
    return wl, inputs, backing


def _judge(wl, inputs: dict, backing: dict, before: dict, outs: dict) -> None:
    """Valid tokens as the float64 reference says; skipped ones leave the whole cache, guards included, as it was."""
    ref = wl.op.reference({**inputs, **{n: before[n][1:NS + 1] for n in backing}}, {}, wl.dim, wl.attr)
    ok = torch.tensor([0 <= p < L for p in POSITIONS])
    for name in ("q_out", "k_out"):
        torch.testing.assert_close(outs[name][ok].double(), ref[name][ok], rtol=1e-6, atol=1e-6)
    for name, b in backing.items():
        assert torch.equal(b[0], before[name][0]) and torch.equal(b[NS + 1], before[name][NS + 1]), name
        torch.testing.assert_close(b[1:NS + 1].double(), ref[name], rtol=1e-6, atol=1e-6)
        untouched = torch.ones(NS, dtype=torch.bool)
        untouched[[s for s in SLOTS if 0 <= s < NS]] = False
        assert torch.equal(b[1:NS + 1][untouched], before[name][1:NS + 1][untouched]), name
    written = [i for i, s in enumerate(SLOTS) if 0 <= s < NS]
    assert torch.equal(inputs["k_cache"][[SLOTS[i] for i in written]], outs["k_out"][written])
    assert torch.equal(inputs["v_cache"][[SLOTS[i] for i in written]], inputs["v"][written])


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_cache_skips_out_of_range_slots_cpu(style):
    from flashgen.runtime.serving.torch_ops import register_all
    register_all()
    wl, inputs, backing = _case(style, seed=3)
    before = {n: b.clone() for n, b in backing.items()}
    q_out, k_out = torch.ops.flashgen.rope_cache(*(inputs[t.name] for t in wl.inputs), style=style)
    _judge(wl, inputs, backing, before, {"q_out": q_out, "k_out": k_out})


def _launch_in_child(wl_json: dict, schedule: dict, inputs: dict) -> tuple[dict, dict]:
    """Run the generated Triton kernel under the interpreter; return the outputs and the caches' buffers."""
    from flashgen.check import poisoned
    from flashgen.targets.kernel import bind_dims
    from flashgen.targets.triton.codegen import generate
    from flashgen.targets.triton.launch import TritonLauncher
    from flashgen.workload import Workload

    wl = Workload.from_json(wl_json)
    backing = {n: torch.cat([g[:1], inputs[n], g[1:]]) for n, g in inputs.pop("guards").items()}
    inputs.update({n: b[1:NS + 1] for n, b in backing.items()})
    outs = poisoned(wl, wl.dim, "cpu")
    TritonLauncher(generate(wl, schedule), wl, get_target("h200"))({**inputs, **outs}, {}, bind_dims(wl, inputs))
    return outs, backing


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_cache_skips_out_of_range_slots_interpreter(interpreter, style):
    wl, inputs, backing = _case(style, seed=4)
    before = {n: b.clone() for n, b in backing.items()}
    schedule = ScheduleSpace(wl, get_target("h200")).default()
    sent = {**{k: v.clone() for k, v in inputs.items() if k not in backing},
            **{n: b[1:NS + 1].clone() for n, b in backing.items()},
            "guards": {n: b[[0, NS + 1]].clone() for n, b in backing.items()}}
    outs, got = interpreter.pool.apply(_launch_in_child, (wl.to_json(), schedule, sent))
    inputs.update({n: b[1:NS + 1] for n, b in got.items()})
    _judge(wl, inputs, got, before, outs)


@pytest.mark.parametrize("op,lens,tables,message", [
    ("paged_decode_attention", [5, 49], [[0, 1, 2], [3, 1, 0]], "context_lens must lie in [1, MAXB*BS=48]"),
    ("paged_decode_attention", [0, 4], [[0, 1, 2], [3, 1, 0]], "context_lens must lie in [1, MAXB*BS=48]"),
    ("paged_decode_attention", [5, 20], [[0, 1, 2], [3, 4, -1]], "block_tables[1, 1] = 4 is outside"),
    ("paged_decode_attention", [17, 3], [[0, -1, 2], [3, 1, 0]], "block_tables[0, 1] = -1 is outside"),
    ("chunked_prefill_attention", [0, 49], [[0, 1, 2], [3, 1, 0]], "prefix_lens must lie in [0, MAXB*BS=48]"),
    ("chunked_prefill_attention", [0, 33], [[9, 9, 9], [3, 1, 7]], "block_tables[1, 2] = 7 is outside"),
])
def test_paged_attention_refuses_tables_outside_the_cache(op, lens, tables, message):
    """Lengths past the table and used entries past the cache are refused before any kernel runs;
    entries past a sequence's length (padding) are not looked at."""
    from flashgen.errors import FlashgenError
    from flashgen.runtime.serving.torch_ops import check_tables
    nb, bs = 4, 16
    t = {"k_cache": torch.zeros(nb, bs, 1, 16), "block_tables": torch.tensor(tables, dtype=torch.int32),
         ("context_lens" if op == "paged_decode_attention" else "prefix_lens"): torch.tensor(lens, dtype=torch.int32)}
    with pytest.raises(FlashgenError, match=message.replace("[", r"\[").replace("*", r"\*")):
        check_tables(op, t, {"MAXB": 3, "L": 48, "B": 2, "Hq": 1, "Hkv": 1, "D": 16, "T": 1})
    t["block_tables"] = torch.tensor([[0, 1, 2], [3, 1, 0]], dtype=torch.int32)
    t[next(n for n in t if n.endswith("lens"))] = torch.tensor([1 - (op != "paged_decode_attention"), 48],
                                                                dtype=torch.int32)
    check_tables(op, t, {"MAXB": 3, "L": 48, "B": 2, "Hq": 1, "Hkv": 1, "D": 16, "T": 1})
