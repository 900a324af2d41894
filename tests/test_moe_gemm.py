"""The moe class: grouped expert GEMMs (moe_gemm_gate_up, moe_gemm_down) from the IR, their alignment
step, schedule space and features, in Triton's interpreter (fp16: its bf16 tl.dot is wrong, so bf16
runs on the GPU, at the end of this module) and built ahead of time for NVIDIA and AMD."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import flashgen
from flashgen.errors import FlashgenError
from flashgen.oplib.moe import moe_align
from flashgen.schedules.features import feature_matrix, feature_names
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from flashgen.targets.triton.codegen import generate, grid
from tests.cases import case_id

H200 = get_target("h200")

# odd shapes: M = 1, tails of every tile (N, K not multiples), many experts with few pairs, top-1/2/4/8,
# and an expert no token chose (make_inputs leaves expert 0 out)
SHAPES = [dict(M=1, N=72, K=40, E=8, topk="2"), dict(M=3, N=40, K=100, E=8, topk="2"),
          dict(M=17, N=33, K=48, E=5, topk="4"), dict(M=5, N=24, K=256, E=16, topk="8"),
          dict(M=40, N=48, K=64, E=3, topk="1")]
CASES = [flashgen.workload(op, dtype="fp16", weights=w, routing=("sorted", "ids")[(i + j) % 2], **s)
         for i, s in enumerate(SHAPES) for op in ("moe_gemm_gate_up", "moe_gemm_down")
         for j, w in enumerate(("half", ("w8a16", "w4a16g128")[i % 2]))
         if not (w == "w4a16g128" and s["K"] % 128)]


@pytest.mark.parametrize("wl", CASES, ids=case_id)
def test_default_schedule(interpreter, wl):
    schedule = ScheduleSpace(wl, H200).default()
    checks = interpreter.check(wl, schedule, "h200", seed=[1, 2])
    assert {c.tensor for c in checks} == {"h" if "gate_up" in wl.op.name else "y"}
    for c in checks:
        assert c.ok, (c, schedule)


@pytest.mark.parametrize("op", ["moe_gemm_gate_up", "moe_gemm_down"])
@pytest.mark.parametrize("block_m,block_n,block_k", [(16, 16, 32), (32, 64, 64)])
@pytest.mark.parametrize("routing", ["sorted", "ids"])
def test_tiles_of_one_expert(interpreter, op, block_m, block_n, block_k, routing):
    """Tokens top-2 over 3 experts: each expert's run spans several row tiles, the last partial (with
    ids routing, 150 tokens: the scan of 300 ids takes three chunks)."""
    wl = flashgen.workload(op, M=40 if routing == "sorted" else 150, N=48, K=100, E=3, topk="2", dtype="fp16",
                           routing=routing)
    s = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": 2}
    assert ScheduleSpace(wl, H200).is_valid(s)
    for c in interpreter.check(wl, s, "h200", seed=5):
        assert c.ok, c


@pytest.mark.parametrize("op", ["moe_gemm_gate_up", "moe_gemm_down"])
def test_ids_routing_by_pair(interpreter, op):
    """Fewer pairs than experts (20 over 24): programs are numbered by pair, and a pair stands for its
    expert only if it is the expert's first; the drawn ids repeat experts (checked here), so a
    second pair serving its expert again would add it twice, and one serving none would leave rows out."""
    wl = flashgen.workload(op, M=5, N=40, K=64, E=24, topk="4", dtype="fp16", routing="ids")
    for seed in (3, 4):
        ids = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(seed))["topk_ids"]
        assert ids.unique().numel() < ids.numel() < 24
    s = {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 2}
    for c in interpreter.check(wl, s, "h200", seed=[3, 4]):
        assert c.ok, c
    launched = grid(generate(wl, s), wl)
    assert launched == (20, 3, 1)  # a slot per pair, one 16-row block each, 3 column tiles


def test_down_adds_into_y():
    """The reference of down keeps y's content: its in-place sum is what the kernel must reproduce,
    and it differs from the content alone (the check would catch a kernel that adds nothing)."""
    wl = flashgen.workload("moe_gemm_down", M=4, N=16, K=32, E=4, topk="2", dtype="fp16")
    t = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(0))
    y0 = t["y"].double().clone()
    ref = wl.op.reference(t, {}, wl.dim, wl.attr)["y"]
    assert (ref - y0).norm() > 0.3 * y0.norm()


def test_align_orders_pairs_by_expert():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (33, 3), generator=g, dtype=torch.int32)
    pairs, offsets = moe_align(ids, 7)
    flat = ids.flatten()
    assert pairs.dtype == offsets.dtype == torch.int32
    assert sorted(pairs.tolist()) == list(range(99))
    assert offsets.tolist() == [0] + torch.bincount(flat.long(), minlength=7).cumsum(0).tolist()
    for e in range(7):
        run = pairs[offsets[e]:offsets[e + 1]]
        assert (flat[run.long()] == e).all() and run.tolist() == sorted(run.tolist())  # by token within
    empty_pairs, empty = moe_align(torch.zeros((0, 2), dtype=torch.int32), 4)
    assert empty.tolist() == [0] * 5 and empty_pairs.numel() == 0


def test_align_leaves_out_ids_of_no_expert():
    """An id outside [0, E) is no expert's: its pairs sort after the last expert's run, past
    expert_offsets[E], and every expert's run is what it would be without them."""
    ids = torch.tensor([[2, 7], [8, 0], [-1, 2], [2**31 - 1, 5], [-(2**31), 8]], dtype=torch.int32)
    pairs, offsets = moe_align(ids, 8)
    assert offsets.tolist() == [0, 1, 1, 3, 3, 3, 4, 4, 5]
    assert pairs.tolist() == [3, 0, 5, 7, 1, 2, 4, 6, 8, 9]  # (the five of no expert last, by token)


NAN = float("nan")
NO_EXPERT = {"E": 8, "minus_one": -1, "huge": 2**31 - 1, "most_negative": -2**31}


def flanked(w: torch.Tensor) -> torch.Tensor:
    """`w` [E, ...] as a view into a buffer with an expert of ones on each side: a read of expert E or
    of expert -1 writes a row or adds to one (not NaN, which would pass for an unwritten row), where
    reading past the tensor would give garbage or a fault."""
    buf = torch.ones((w.shape[0] + 2, *w.shape[1:]), dtype=w.dtype, device=w.device)
    buf[1:-1] = w
    return buf[1:-1]


def with_an_id_of_no_expert(wl, bad: int, seed: int) -> tuple[dict, torch.Tensor]:
    """The op's inputs (half weights, flanked) routed by distinct random ids per token, one pair's id
    replaced by `bad`; and the ids."""
    g = torch.Generator().manual_seed(seed)
    t = wl.op.make_inputs(wl.dim, wl.attr, g)
    m, e, kt = wl.dim["M"], wl.dim["E"], wl.dim["KT"]
    ids = torch.stack([torch.randperm(e, generator=g)[:kt] for _ in range(m)]).to(torch.int32)
    ids[m // 2, kt - 1] = bad
    t.pop("topk_ids", None), t.pop("sorted_pairs", None), t.pop("expert_offsets", None)
    if wl.attr["routing"] == "ids":
        t["topk_ids"] = ids
    else:
        t["sorted_pairs"], t["expert_offsets"] = moe_align(ids, e)
    t["w"] = flanked(t["w"])
    return t, ids


def skipping_reference(wl, t: dict, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The op pair by pair in float64, a pair whose id is outside [0, E) left out (its row of h NaN:
    the kernel must not write it)."""
    kt, n, e = wl.dim["KT"], wl.dim["N"], wl.dim["E"]
    w = t["w"].double()
    if wl.op.name == "moe_gemm_gate_up":
        h = torch.full((ids.numel(), n), NAN, dtype=torch.float64)
        for p, ex in enumerate(ids.flatten().tolist()):
            if 0 <= ex < e:
                y = t["x"][p // kt].double() @ w[ex].T
                h[p] = F.silu(y[:n]) * y[n:]
        return {"h": h}
    y = t["y"].double().clone()
    for p, ex in enumerate(ids.flatten().tolist()):
        if 0 <= ex < e:
            y[p // kt] += t["topk_weights"][p].double() * (t["h"][p].double() @ w[ex].T)
    return {"y": y}


def assert_skipped(wl, outs: dict, want: dict) -> None:
    """Rows of the served pairs as the reference's (check.compare), rows of skipped pairs unwritten."""
    from flashgen.check import compare
    for name, ref in want.items():
        served = ~ref.isnan().all(-1)
        assert torch.equal(outs[name].isnan().all(-1), ~served), name  # skipped rows: still the poison
        for c in compare(wl, {name: outs[name][served]}, {name: ref[served]}):
            assert c.ok, c


@pytest.fixture(scope="module")
def own_interpreter():
    """An interpreter pool of these tests' own: a fault kills its worker, and the one the pool starts
    in its place is not in interpreter mode (the tests after a fault fail on it too), so the session's
    pool is kept out of their way."""
    from flashgen.targets.triton.interpret import InterpreterPool
    with InterpreterPool(processes=1) as pool:
        yield pool


@pytest.mark.parametrize("bad", NO_EXPERT.values(), ids=NO_EXPERT.keys())
@pytest.mark.parametrize("routing,m", [("ids", 3), ("ids", 9), ("sorted", 9)], ids=["ids-by_pair", "ids", "sorted"])
@pytest.mark.parametrize("op", ["moe_gemm_gate_up", "moe_gemm_down"])
def test_ids_of_no_expert_are_skipped(own_interpreter, op, routing, m, bad):
    """A pair whose id is E, -1, huge or most negative (a broken router's) adds nothing and reads no
    weight: with the ids routing when programs are numbered by pair (3 tokens x 2 < 8 experts: the
    pair's id is taken as its program's expert) and by expert, and with the sorted routing (moe_align
    leaves it out). The interpreter would read past the weights (the flanks here) or fault."""
    from flashgen.targets.triton.interpret import _run_in_child
    wl = flashgen.workload(op, M=m, N=24, K=64, E=8, topk="2", dtype="fp16", routing=routing)
    t, ids = with_an_id_of_no_expert(wl, bad, seed=m)
    want = skipping_reference(wl, t, ids)
    s = {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 4, "num_stages": 2}
    # (a fault kills the worker and its task with it: wait a bounded time; y is updated in place, in
    # memory the pool shares)
    outs = own_interpreter.pool.apply_async(_run_in_child, (wl.to_json(), s, "h200", t, {})).get(timeout=300)
    assert_skipped(wl, {**outs, **({"y": t["y"]} if "y" in want else {})}, want)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", NO_EXPERT.values(), ids=NO_EXPERT.keys())
@pytest.mark.parametrize("routing,m", [("ids", 3), ("ids", 9), ("sorted", 9)], ids=["ids-by_pair", "ids", "sorted"])
@pytest.mark.parametrize("op", ["moe_gemm_gate_up", "moe_gemm_down"])
def test_ids_of_no_expert_are_skipped_on_gpu(op, routing, m, bad):
    """The same in bf16 on the GPU (the decoder's kernels), the flanks made on the device."""
    from flashgen.check import poisoned
    dev = torch.device("cuda")
    wl = flashgen.workload(op, M=m, N=24, K=64, E=8, topk="2", dtype="bf16", routing=routing)
    t, ids = with_an_id_of_no_expert(wl, bad, seed=m)
    want = skipping_reference(wl, t, ids)
    given = {k: flanked(v.to(dev)) if k == "w" else v.to(dev) for k, v in t.items()}
    kernel = flashgen.compile(wl, flashgen.targets.device_target(dev), db=None)
    outs = kernel.run(given, poisoned(wl, wl.dim, dev))
    got = {**outs, **({"y": given["y"]} if "y" in want else {})}
    assert_skipped(wl, {k: v.cpu() for k, v in got.items()}, want)


def test_generated_source_reads_like_the_op():
    wl = flashgen.workload("moe_gemm_gate_up", M=8, N=768, K=2048, E=128, topk="8", dtype="bf16")
    src = generate(wl, ScheduleSpace(wl, H200).default()).source
    assert src.count("tl.dot(") == 2 and "acc_gate" in src and "acc_up" in src  # one loop, A tile shared
    assert src.count("tl.load(x_ptr") == 1 and "tl.sigmoid(acc_gate)" in src
    down = flashgen.workload("moe_gemm_down", M=8, N=2048, K=768, E=128, topk="8", dtype="bf16")
    assert "tl.atomic_add(y_ptr" in generate(down, ScheduleSpace(down, H200).default()).source


@pytest.mark.parametrize("weights,m", [("w4a16g128", 1), ("w4a16g128", 16), ("w4a8g128", 1), ("w4a8g128", 256)])
def test_int4_experts_unpack_whole_word_tiles(weights, m):
    """The int4 forms' default tiles (ALU at one token, matrix tiles beyond) load each k step's packed
    words once as a [block_k / 8, block_n] tile per Contract (gate's and up's rows apart) and their group
    scales once per group, never a word or a scale per element: W4A16's ALU tiles take the dense GEMV's
    terms (eight codes of each word under an fp32 exponent, in place), the others unpack the words by a
    reshape; W4A16's matrix tiles scale each group's dot of the codes."""
    wl = flashgen.workload("moe_gemm_gate_up", M=m, N=14336, K=4096, E=8, topk="2", dtype="bf16", weights=weights,
                           routing="ids")
    s = ScheduleSpace(wl, H200).default()
    assert s["block_k"] % 128 == 0, s
    src = generate(wl, s).source
    scales = "scales" if weights == "w4a16g128" else "w_group"
    assert src.count("tl.load(w_packed_ptr") == 2 and src.count(f"tl.load({scales}_ptr") == 2
    if weights == "w4a16g128" and m == 1:  # the dense GEMV's terms: each code under an fp32 exponent, in place
        assert src.count("words_w_packed = tl.load(w_packed_ptr") == 2 and "tl.reshape(words" not in src
        assert src.count("| magic).to(tl.float32, bitcast=True)") == 16
    else:
        for words in ("words_w_packed", "words_w_packed_1"):
            assert f"{words} = tl.load(w_packed_ptr" in src and f"tl.reshape({words}, [BLOCK_K // 128, 1, 16, BLOCK_N])" in src
    if weights == "w4a16g128" and m > 1:  # codes dotted, each group's dot then scaled
        assert src.count("out_dtype=tl.float32) * ") == 2
    assert "kb // 128" not in src and "kb % 128" not in src  # (the per-element word and shift)


@pytest.mark.parametrize("op", ["moe_gemm_gate_up", "moe_gemm_down"])
def test_int4_experts_compute_as_the_dense_gemm(op):
    """w4a16g128 experts mean what the dense gemm_w4a16 means: each expert's product is the dense op's
    reference on its pairs' rows (codes times group scales, exact, never rounded to 16 bits), on fresh
    inputs, so the kernels may sum codes times x per group in fp32 before the scale, as the dense tiles do."""
    wl = flashgen.workload(op, M=5, N=24, K=256, E=3, topk="2", dtype="bf16", weights="w4a16g128", routing="ids")
    t = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(7))
    got = wl.op.reference(t, {}, wl.dim, wl.attr)
    kt, n = wl.dim["KT"], wl.dim["N"]
    pairs = {e: (t["topk_ids"].flatten() == e).nonzero()[:, 0] for e in range(wl.dim["E"])}
    want = t["y"].double().clone() if op == "moe_gemm_down" else torch.zeros(5 * kt, n, dtype=torch.float64)
    for e, p in pairs.items():
        if not len(p):
            continue
        x = t["x"][p // kt] if op == "moe_gemm_gate_up" else t["h"][p]
        dense = flashgen.workload("gemm_w4a16", M=len(p), N=t["w_packed"].shape[1], K=256, G=128, dtype="bf16")
        y = dense.op.reference({"x": x, "w_packed": t["w_packed"][e], "scales": t["scales"][e]}, {}, dense.dim,
                               dense.attr)["y"]
        if op == "moe_gemm_gate_up":
            want[p] = F.silu(y[:, :n]) * y[:, n:]
        else:
            want.index_add_(0, p // kt, y * t["topk_weights"][p, None].double())
    name = "h" if op == "moe_gemm_gate_up" else "y"
    torch.testing.assert_close(got[name], want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "gfx942"])
@pytest.mark.parametrize("weights", ["half", "w8a16", "w4a16g128"])
def test_aot_compile(target, weights):
    """Mixtral's experts (E=8, top-2, 4096 x 14336) and Qwen3-MoE's (E=128, top-8, 2048 x 768)."""
    for op, kw in (("moe_gemm_gate_up", dict(N=14336, K=4096, E=8, topk="2")),
                   ("moe_gemm_down", dict(N=2048, K=768, E=128, topk="8"))):
        k = flashgen.compile(flashgen.workload(op, M=16, dtype="bf16", weights=weights, **kw), target)
        assert k.binary[:4] == b"\x7fELF" and k.metadata["binary_symbol"].encode() in k.binary
        assert k.binary_kind == ("cubin" if target.startswith("sm_") else "hsaco")


@pytest.mark.parametrize("weights,m", [(w, 1) for w in ("w8a16", "w4a16g128", "w8a8", "w4a8g128")]
                         + [("w8a8", 16), ("w4a8g128", 64)])
def test_aot_compile_int8_and_alu_tiles(weights, m):
    """The int8-activation forms (matrix tiles at 16 and 64 tokens) and the quantized experts' decode
    default, an ALU tile, built for sm_90: Mixtral's experts at batch 1 run 1-pair ALU tiles."""
    for op, kw in (("moe_gemm_gate_up", dict(N=14336, K=4096)), ("moe_gemm_down", dict(N=4096, K=14336))):
        wl = flashgen.workload(op, M=m, E=8, topk="2", dtype="bf16", weights=weights, routing="ids", **kw)
        k = flashgen.compile(wl, "sm_90")
        assert (k.schedule["block_m"] < 16) == (m == 1), k.schedule
        assert k.binary[:4] == b"\x7fELF" and k.metadata["binary_symbol"].encode() in k.binary
        assert ("tl.dot(" in k.source) == (m > 1)


@pytest.mark.parametrize("target", ["h200", "sm_80", "gfx942"])
@pytest.mark.parametrize("m", [1, 64, 4096])
def test_space_and_features(target, m):
    tgt = get_target(target)
    for op in ("moe_gemm_gate_up", "moe_gemm_down"):
        wl = flashgen.workload(op, M=m, N=768, K=2048, E=128, topk="8", dtype="bf16")
        space = ScheduleSpace(wl, tgt)
        assert space.is_valid(space.default())
        points = list(space)[:200]
        x = feature_matrix(wl, points, tgt)
        assert x.shape == (len(points), len(feature_names("moe"))) and np.isfinite(x).all()


def test_features_rank_decode_by_touched_bytes():
    """At M = 1 the estimate follows the touched experts' bytes: top-8 of 128 reads 4x what top-2 of
    128 does (launch and early-exit costs are the same for both)."""
    from flashgen.schedules.features import analytic_latency_us

    s = [ScheduleSpace(flashgen.workload("moe_gemm_down", M=1, N=4096, K=4096, E=128, topk="8"), H200).default()]
    t8 = analytic_latency_us(flashgen.workload("moe_gemm_down", M=1, N=4096, K=4096, E=128, topk="8"), s, H200)[0]
    t2 = analytic_latency_us(flashgen.workload("moe_gemm_down", M=1, N=4096, K=4096, E=128, topk="2"), s, H200)[0]
    assert 2.5 < t8 / t2 < 4.0


@pytest.mark.parametrize("kw,match", [
    (dict(E=4, topk="8"), "topk=8 is more than the E=4 experts"),
    (dict(E=8, topk="2", K=100, weights="w4a16g128"), "K=100 is not a multiple of the int4 weights' group of 128"),
    (dict(E=8, topk="3"), "topk=3 is not supported"),
])
def test_bad_workloads_are_one_line(kw, match):
    args = {"M": 4, "N": 64, "K": 128, **kw}
    with pytest.raises(FlashgenError, match=match):
        flashgen.workload("moe_gemm_gate_up", **args)


def test_cpu_refuses_in_one_line():
    """The moe class has no CPU generator: the torch op says so before anything is chosen or built."""
    from flashgen.runtime.serving.torch_ops import register_all

    register_all()
    ids = torch.tensor([[0, 1], [1, 2], [2, 3]], dtype=torch.int32)
    with pytest.raises(FlashgenError, match=r"^moe kernels are not generated for cpu/host yet"):
        torch.ops.flashgen.moe_gemm_gate_up(torch.randn(3, 64, dtype=torch.float16), topk_ids=ids, routing="ids",
                                            w=torch.randn(4, 32, 64, dtype=torch.float16))


# ---- on the GPU (bf16 and fp16, the decoder's path) -------------------------------------------------
GPU_CASES = [flashgen.workload(op, dtype=dt, weights=w, routing=routing, **s) for s in (
    dict(M=1, N=320, K=512, E=8, topk="2"), dict(M=33, N=200, K=384, E=16, topk="4"),
    dict(M=300, N=256, K=256, E=128, topk="8")) for op in ("moe_gemm_gate_up", "moe_gemm_down")
    for dt, w, routing in (("bf16", "half", "sorted"), ("bf16", "half", "ids"), ("fp16", "w8a16", "ids"),
                           ("bf16", "w4a16g128", "sorted"), ("fp16", "w4a16g128", "ids"), ("bf16", "w8a8", "ids"),
                           ("bf16", "w8a8", "sorted"), ("bf16", "w4a8g128", "ids"), ("fp16", "w4a8g128", "sorted"))]


@pytest.mark.gpu
@pytest.mark.parametrize("wl", GPU_CASES, ids=case_id)
def test_moe_gemm_on_gpu(wl):
    from flashgen.check import check

    dev = torch.device("cuda")
    kernel = flashgen.compile(wl, flashgen.targets.device_target(dev), db=None)
    for seed in (0, 1):
        for c in check(wl, lambda i, o, p: kernel.run(i, o, p), seed, dev):
            assert c.ok, (c, kernel.schedule)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["half", "w8a16", "w4a16g128", "w8a8", "w4a8g128"])
@pytest.mark.parametrize("block_m,block_k", [(1, 1024), (2, 512), (4, 256), (8, 128)])
def test_alu_tiles_on_gpu(weights, block_m, block_k):
    """ALU tiles of 1-8 pairs in bf16 on the GPU, both routings, Mixtral-like widths cut down, against
    the float64 reference (the interpreter checks them in fp16 only)."""
    from flashgen.check import check

    dev = torch.device("cuda")
    for routing, m in (("ids", 5), ("sorted", 9)):
        wl = flashgen.workload("moe_gemm_down", M=m, N=256, K=1408, E=6, topk="2", dtype="bf16", weights=weights,
                               routing=routing)
        s = {"block_m": block_m, "block_n": 16, "block_k": block_k, "num_warps": 4, "num_stages": 3}
        assert ScheduleSpace(wl, H200).is_valid(s), s
        kernel = flashgen.compile(wl, flashgen.targets.device_target(dev), schedule=s, db=None)
        for c in check(wl, lambda i, o, p: kernel.run(i, o, p), 0, dev):
            assert c.ok, (c, s)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["moe_gemm_gate_up", "moe_gemm_down"])
@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_int4_matrix_tiles_on_gpu(op, block_k):
    """bf16 matrix tiles of int4 codes (W4A16) on the GPU: codes (exact in bf16) dotted with x, each
    group's dot then scaled, per-element codes in steps shallower than a word block, against the exact
    float64 reference (down's fp32 y at fp32's tolerance: a weight rounded to bf16 fails it)."""
    from flashgen.check import check

    dev = torch.device("cuda")
    wl = flashgen.workload(op, M=40, N=200, K=384, E=3, topk="2", dtype="bf16", weights="w4a16g128", routing="sorted")
    s = {"block_m": 16, "block_n": 64, "block_k": block_k, "num_warps": 4, "num_stages": 3}
    assert ScheduleSpace(wl, H200).is_valid(s), s
    kernel = flashgen.compile(wl, flashgen.targets.device_target(dev), schedule=s, db=None)
    for c in check(wl, lambda i, o, p: kernel.run(i, o, p), 0, dev):
        assert c.ok, (c, s)


@pytest.mark.gpu
def test_bad_calls_on_gpu_are_one_line():
    """A stacked weight of the wrong width, and ids given to the sorted routing: one error naming the
    tensor, before any launch."""
    from flashgen.runtime.serving.torch_ops import register_all

    register_all()
    x = torch.randn(3, 64, dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor([[0, 1], [1, 2], [2, 3]], dtype=torch.int32, device="cuda")
    pairs, offsets = moe_align(ids, 4)
    with pytest.raises(FlashgenError, match=r"input 'w' has shape \(4, 32, 65\), expected \(4, 32, 64\)"):
        torch.ops.flashgen.moe_gemm_gate_up(x, sorted_pairs=pairs, expert_offsets=offsets,
                                            w=torch.randn(4, 32, 65, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(FlashgenError, match="missing input 'sorted_pairs'"):
        torch.ops.flashgen.moe_gemm_gate_up(x, topk_ids=ids, w=torch.randn(4, 32, 64, dtype=torch.bfloat16, device="cuda"))


def test_fp32_tolerance_follows_the_sum_length():
    """y is fp32, but each element sums K products in fp32: Mixtral's down (K = 14336) is allowed the
    sums' rounding (a bf16-exact kernel measured 1.3e-5 on an H200), a short sum keeps fp32's 1e-5,
    and a bf16 output keeps bf16's."""
    from flashgen.check import REL_TOL, tolerance
    long = flashgen.workload("moe_gemm_down", M=4, N=4096, K=14336, E=8, topk="2", dtype="bf16")
    short = flashgen.workload("moe_gemm_down", M=4, N=4096, K=256, E=8, topk="2", dtype="bf16")
    assert 2e-5 < tolerance(long, "fp32") < 5e-5
    assert tolerance(short, "fp32") == REL_TOL["fp32"] and tolerance(long, "bf16") == REL_TOL["bf16"]
    assert tolerance(flashgen.workload("rmsnorm", M=4, N=8192, dtype="fp32"), "fp32") == REL_TOL["fp32"]


# ---- int8 activations (w8a8, w4a8g128) and ALU tiles of 1-8 pairs --------------------------------
# odd shapes: E not a power of two, one or a few pairs per expert, an expert no token chose (make_inputs
# leaves expert 0 out), K not a multiple of the k step (w8a8); both routings; matrix and ALU tiles
INT8_SHAPES = [dict(M=1, N=40, K=128, E=5, topk="2"), dict(M=3, N=24, K=256, E=6, topk="2"),
               dict(M=5, N=33, K=128, E=3, topk="1")]
# (each shape, op and format in one of the three tiles, in turn: every tile meets both ops and formats)
INT8_TILES = (("ids", 1), ("sorted", 2), ("ids", 16))
INT8_CASES = [(flashgen.workload(op, dtype="fp16", weights=w, routing=routing, **shape), 1 if bm == 2 and shape["M"] == 1 else bm)
              for i, (shape, op, w) in enumerate(itertools.product(INT8_SHAPES, ("moe_gemm_gate_up", "moe_gemm_down"),
                                                                   ("w8a8", "w4a8g128")))
              for routing, bm in [INT8_TILES[i % len(INT8_TILES)]]]


@pytest.mark.parametrize("wl,block_m", INT8_CASES, ids=lambda v: case_id(v) if not isinstance(v, int) else f"bm{v}")
def test_int8_activations(interpreter, wl, block_m):
    """int8 activations per row times int8 codes (w8a8) or 4-bit codes times integer group scales
    (w4a8g128), summed in int32 and scaled after, against the float64 reference on fresh inputs, in
    ALU tiles of 1-2 pairs and 16-pair matrix tiles."""
    s = {"block_m": block_m, "block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 2}  # (whole int4 word tiles)
    assert ScheduleSpace(wl, H200).is_valid(s), s
    for c in interpreter.check(wl, s, "h200", seed=[11, 12]):
        assert c.ok, (c, s)


MOE_OPS = ("moe_gemm_gate_up", "moe_gemm_down")


@pytest.mark.parametrize("op,weights,block_m,block_k", [(op, "half", 4, 256) for op in MOE_OPS]
                         + [("moe_gemm_down", "w4a16g128", 2, 256)] + [(op, "w4a16g128", 16, 128) for op in MOE_OPS])
def test_alu_tiles(interpreter, op, weights, block_m, block_k):
    """Tiles of 16-bit activations over the tail of the columns and of every k step (K = 384 in steps
    of 256: int4 words and group scales masked), the sorted routing, E = 7: ALU tiles of 4 pairs and of
    int4 codes in the dense GEMV's terms (down's: gate_up's meet them in test_default_schedule), and
    matrix tiles of int4 codes unpacked from their words tile into the operand, each group's dot scaled
    after, against the exact float64 reference."""
    wl = flashgen.workload(op, M=6, N=40, K=384, E=7, topk="2", dtype="fp16", weights=weights, routing="sorted")
    s = {"block_m": block_m, "block_n": 16, "block_k": block_k, "num_warps": 8, "num_stages": 2}
    assert ScheduleSpace(wl, H200).is_valid(s)
    for c in interpreter.check(wl, s, "h200", seed=[21, 22]):
        assert c.ok, c


@pytest.mark.parametrize("weights,block_m", [("w8a8", 1), ("w4a8g128", 2), ("w4a8g128", 16)])
@pytest.mark.parametrize("op,bad", [("moe_gemm_gate_up", 8), ("moe_gemm_down", -1)], ids=["gate_up-E", "down-minus_one"])
def test_int8_forms_skip_ids_of_no_expert(own_interpreter, op, weights, block_m, bad):
    """A pair whose id is outside [0, E) adds nothing and reads no weight in the int8 forms too (every
    weight tensor flanked by an expert of ones on each side)."""
    from flashgen.targets.triton.interpret import _run_in_child
    wl = flashgen.workload(op, M=5, N=32, K=128, E=8, topk="2", dtype="fp16", weights=weights, routing="ids")
    g = torch.Generator().manual_seed(block_m)
    t = wl.op.make_inputs(wl.dim, wl.attr, g)
    t["topk_ids"][2, 1] = bad
    for name in ("w_q", "w_packed", "w_group", "w_scale"):
        if name in t:
            t[name] = flanked(t[name])
    want = wl.op.reference(t, {}, wl.dim, wl.attr)
    if op == "moe_gemm_gate_up":
        want["h"][2 * 2 + 1] = NAN  # (the reference writes 0 there; the kernel must leave the row alone)
    s = {"block_m": block_m, "block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 2}
    outs = own_interpreter.pool.apply_async(_run_in_child, (wl.to_json(), s, "h200", t, {})).get(timeout=300)
    assert_skipped(wl, {**outs, **({"y": t["y"]} if "y" in want else {})}, want)


@pytest.mark.parametrize("op", ["moe_gemm_gate_up", "moe_gemm_down"])
@pytest.mark.parametrize("routing", ["ids", "sorted"])
def test_one_pair_tiles_of_whole_columns(interpreter, op, routing):
    """One-pair ALU tiles whose column tiles divide N (no column mask in the k loop; decode's
    Mixtral shapes): every pair's row is stored whole."""
    wl = flashgen.workload(op, M=5, N=32, K=128, E=8, topk="2", dtype="fp16", weights="w8a8", routing=routing)
    s = {"block_m": 1, "block_n": 16, "block_k": 128, "num_warps": 4, "num_stages": 2}
    for c in interpreter.check(wl, s, "h200", seed=[31, 32]):
        assert c.ok, c
