"""moe_route against a top-k written here (not the op's reference), on heavily tied logits, and its
refusals. Runs the CPU kernel (TVM) for real; the Triton kernel is checked in the interpreter suite.
On non-finite logits (NaN, +inf, -inf) both kernels, and the Triton one in the interpreter here, give
the reference's ids and weights exactly (NaN where it has NaN): never an id outside [0, E)."""
from __future__ import annotations

import pytest
import torch

import flashgen

from flashgen.check import poisoned
from flashgen.errors import FlashgenError
from flashgen.ir import dtypes
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


# ---- non-finite logits: ids always name an expert, weights as the reference gives them ----------------
NAN, INF = float("nan"), float("inf")


def non_finite_logits(e: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of random logits, each but the last broken one way: one NaN, all NaN, NaN and +inf, one
    +inf, two +inf (a tie), one -inf, all -inf, all -inf but one; the last row finite."""
    g = torch.Generator().manual_seed(e)
    x = torch.randn(9, e, generator=g) * 2
    x[0, 3] = NAN
    x[1] = NAN
    x[2, e - 1], x[2, 1] = NAN, INF
    x[3, 5] = INF
    x[4, 2] = x[4, e - 2] = INF
    x[5, 4] = -INF
    x[6] = -INF
    x[7] = -INF
    x[7, e - 3] = 0.5
    return x.to(dtype)


def assert_follows_reference(wl, inputs: dict, out: dict) -> None:
    """ids exactly the reference's (so in [0, E)), NaN weights where its are, the others close."""
    ref = wl.op.reference(inputs, {}, wl.dim, wl.attr)
    ids, w = out["topk_ids"], out["topk_weights"].double()
    assert ((ids >= 0) & (ids < wl.dim["E"])).all(), ids
    assert ids.tolist() == ref["topk_ids"].tolist()
    assert torch.equal(w.isnan(), ref["topk_weights"].isnan()), (w, ref["topk_weights"])
    torch.testing.assert_close(w, ref["topk_weights"], rtol=1e-6, atol=1e-7, equal_nan=True)


def route_inputs(wl, bias_inf: bool) -> dict:
    t = {"logits": non_finite_logits(wl.dim["E"], dtypes.TORCH[wl.attr["dtype"]])}
    if wl.attr["scoring"] == "sigmoid_bias":
        t["bias"] = torch.rand(wl.dim["E"], generator=torch.Generator().manual_seed(1)) * 0.5
        if bias_inf:  # a +inf score: NaN still ranks above it
            t["bias"][4] = INF
    return t


ROUTES = [dict(E=8, topk="2", scoring="softmax", renorm="yes", dtype="fp32"),
          dict(E=8, topk="2", scoring="softmax", renorm="no", dtype="bf16"),
          dict(E=60, topk="8", scoring="softmax", renorm="yes", dtype="bf16"),
          dict(E=16, topk="4", scoring="sigmoid_bias", renorm="yes", dtype="fp32"),
          dict(E=16, topk="4", scoring="sigmoid_bias", renorm="no", dtype="fp32")]


# each case, and the sigmoid ones again with a +inf bias
CASES = [(kw, False) for kw in ROUTES] + [(kw, True) for kw in ROUTES if kw["scoring"] == "sigmoid_bias"]
CASE_IDS = ["-".join(map(str, kw.values())) + ("-bias_inf" if b else "") for kw, b in CASES]


@pytest.mark.parametrize("kw,bias_inf", CASES, ids=CASE_IDS)
def test_non_finite_logits_in_the_interpreter(interpreter, kw, bias_inf):
    """The Triton kernel (one tile, and a row walked in tiles of 16): a NaN never makes an id of E,
    nor is it skipped for finite weights; +inf and all -inf give softmax's NaN, with or without
    renormalising."""
    wl = workload("moe_route", M=9, **kw)
    inputs = route_inputs(wl, bias_inf)
    for schedule in (ScheduleSpace(wl, get_target("h200")).default(), {"block_r": 2, "block_c": 16, "num_warps": 1}):
        assert_follows_reference(wl, inputs, interpreter.run(wl, schedule, "h200", inputs))


@pytest.mark.parametrize("kw,bias_inf", CASES, ids=CASE_IDS)
def test_non_finite_logits_on_the_cpu(kw, bias_inf):
    """The CPU kernel (TVM, whose simplifier must not fold the NaN test away), as the decoder runs it."""
    wl = workload("moe_route", M=9, **kw)
    inputs = route_inputs(wl, bias_inf)
    out = poisoned(wl, wl.dim, "cpu")
    tvm_backend.build(wl, ScheduleSpace(wl, CPU).default(), CPU).launcher({**inputs, **out}, {}, wl.dim)
    assert_follows_reference(wl, inputs, out)


def test_the_reference_is_torchs_softmax_and_sort():
    """What the kernels follow on non-finite rows is torch's own softmax and top-k order: NaN weights
    for every broken row, NaN ranking above +inf."""
    wl = workload("moe_route", M=9, E=8, topk="2", renorm="no", dtype="fp32")
    ref = wl.op.reference({"logits": non_finite_logits(8, torch.float32)}, {}, wl.dim, wl.attr)
    broken = [0, 1, 2, 3, 4, 6]  # (one -inf is a probability of 0; so are all -inf but one)
    assert ref["topk_weights"].isnan().any(-1).tolist() == [m in broken for m in range(9)]
    assert ref["topk_ids"][broken].tolist() == [[0, 1]] * 6  # all NaN: a stable sort keeps their order
    assert torch.sort(torch.tensor([INF, NAN]), descending=True, stable=True).indices.tolist() == [1, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("kw", ROUTES, ids=lambda kw: "-".join(map(str, kw.values())))
def test_non_finite_logits_on_gpu(kw):
    """The compiled kernel: the device's own max and compare instructions, and a compiler that must
    keep the NaN test."""
    from flashgen.targets import device_target
    dev = torch.device("cuda")
    wl = workload("moe_route", M=9, **kw)
    kernel = flashgen.compile(wl, device_target(dev), db=None)
    for bias_inf in (False, True) if kw["scoring"] == "sigmoid_bias" else (False,):
        inputs = route_inputs(wl, bias_inf)
        out = kernel.run({k: v.to(dev) for k, v in inputs.items()})
        assert_follows_reference(wl, inputs, {k: v.cpu() for k, v in out.items()})
