"""moe_route against a top-k written here (not the op's reference), on heavily tied logits, and its
refusals. Runs the CPU kernel (TVM) for real; the Triton kernel is checked in the interpreter suite."""
from __future__ import annotations

import pytest
import torch

import flashgen

from flashgen.errors import FlashgenError
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from flashgen.workload import workload

tvm_backend = pytest.importorskip("flashgen.targets.tvm_backend")
CPU = get_target("cpu")


def lowest_index_topk(logits: torch.Tensor, k: int, renorm: bool) -> tuple[list, list]:
    """softmax over the experts, then the k largest, equal values in index order."""
    prob = torch.softmax(logits.double(), dim=-1)
    ids = [sorted(range(len(row)), key=lambda i: (-row[i], i))[:k] for row in prob.tolist()]
    w = [[prob[m, i].item() for i in row] for m, row in enumerate(ids)]
    return ids, [[v / sum(row) for v in row] for row in w] if renorm else w


@pytest.mark.parametrize("e,topk,renorm,dtype,block_c", [(8, "2", "yes", "bf16", 8), (60, "8", "no", "fp16", 16),
                                                         (128, "8", "yes", "fp32", 32), (8, "8", "no", "bf16", 8)])
def test_matches_lowest_index_topk(e, topk, renorm, dtype, block_c):
    """Logits on a coarse grid (a few distinct values a row) make ties the rule: the lowest index wins."""
    wl = workload("moe_route", M=17, E=e, topk=topk, renorm=renorm, dtype=dtype)
    schedule = {"block_r": 4, "block_c": block_c, "num_warps": 1}
    assert ScheduleSpace(wl, CPU).is_valid(schedule)
    k = tvm_backend.build(wl, schedule, CPU)
    g = torch.Generator().manual_seed(e)
    logits = (torch.randint(-3, 4, (17, e), generator=g) * 0.5).to(getattr(torch, {"bf16": "bfloat16",
                                                                              "fp16": "float16"}.get(dtype, "float32")))
    ids = torch.full((17, int(topk)), -1, dtype=torch.int32)
    weights = torch.full((17, int(topk)), float("nan"))
    k.launcher({"logits": logits, "topk_ids": ids, "topk_weights": weights}, {}, wl.dim)
    want_ids, want_w = lowest_index_topk(logits, int(topk), renorm == "yes")
    assert ids.tolist() == want_ids
    torch.testing.assert_close(weights.double(), torch.tensor(want_w, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    if renorm == "yes":
        torch.testing.assert_close(weights.sum(-1), torch.ones(17), rtol=1e-6, atol=1e-6)


def test_minus_infinity_logits_still_pick_distinct_experts():
    """A row whose experts are all masked (-inf) but the first still picks k distinct, lowest first."""
    wl = workload("moe_route", M=2, E=8, topk="4", renorm="no", dtype="fp32")
    k = tvm_backend.build(wl, ScheduleSpace(wl, CPU).default(), CPU)
    logits = torch.full((2, 8), float("-inf"))
    logits[:, 5] = 1.0
    ids, w = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4)
    k.launcher({"logits": logits, "topk_ids": ids, "topk_weights": w}, {}, wl.dim)
    assert ids.tolist() == [[5, 0, 1, 2]] * 2
    assert w.tolist() == [[1.0, 0.0, 0.0, 0.0]] * 2


@pytest.mark.parametrize("kw,message", [({"E": 4, "topk": "8"}, "topk=8 is more than the E=4 experts"),
                                        ({"E": 0}, "dim E must be positive"),
                                        ({"E": 8, "topk": "2", "K": 4}, "dim K=4 contradicts topk=2")])
def test_bad_input_is_one_line(kw, message):
    with pytest.raises(FlashgenError) as e:
        workload("moe_route", M=3, dtype="bf16", **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_k_is_set_by_topk():
    wl = workload("moe_route", M=3, E=60, topk="4")
    assert wl.dim["K"] == 4 and wl.shape("topk_ids") == wl.shape("topk_weights") == (3, 4)
    assert wl == workload("moe_route", M=3, E=60, topk="4", K=4)
    assert wl.from_json(wl.to_json()) == wl


def test_moe_route_as_a_torch_op():
    """torch.ops.flashgen.moe_route binds K from its topk attr (no tensor carries it)."""
    from flashgen.runtime import register_all
    register_all()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))
    ids, weights = torch.ops.flashgen.moe_route(x, topk="2")
    top = torch.topk(torch.softmax(x.double(), -1), 2)
    assert ids.tolist() == top.indices.tolist()
    torch.testing.assert_close(weights.double(), top.values / top.values.sum(-1, keepdim=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("renorm", ["yes", "no"])
def test_sigmoid_bias_scoring(renorm):
    """DeepSeek-V3's router: the bias picks the experts (here it overturns the logits' order for
    some tokens), the weights are the picks' sigmoids without it, renormalised if asked."""
    wl = workload("moe_route", M=9, E=16, topk="4", scoring="sigmoid_bias", renorm=renorm, dtype="fp32")
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 16, generator=g)
    bias = torch.rand(16, generator=g) * 0.5
    kernel = flashgen.compile(wl, CPU)
    out = kernel.run({"logits": logits, "bias": bias})
    sig = torch.sigmoid(logits.double())
    want = [sorted(range(16), key=lambda i: (-(row[i] + bias[i].item()), i))[:4] for row in sig.tolist()]
    assert out["topk_ids"].tolist() == want
    assert want != [sorted(range(16), key=lambda i: -row[i])[:4] for row in sig.tolist()]  # the bias mattered
    w = torch.tensor([[sig[m, i].item() for i in row] for m, row in enumerate(want)], dtype=torch.float64)
    if renorm == "yes":
        w = w / w.sum(-1, keepdim=True)
    assert torch.allclose(out["topk_weights"].double(), w, rtol=1e-6, atol=0)
