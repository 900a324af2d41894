"""Generated kernels on the running GPU against the float64 reference (run on the device: -m gpu)."""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.check import check, poisoned
from flashgen.schedules.space import ScheduleSpace
from tests.cases import INT4_K576_OPS, case_id, form_schedules, numerics_cases

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from flashgen.targets import device_target  # noqa: E402
from flashgen.runtime.serving.torch_ops import dispatcher  # noqa: E402

DEVICE = torch.device("cuda")
TARGET = device_target(DEVICE)
CASES = [wl for wl in numerics_cases(Ms=(1, 3, 17, 1000)) if all(
    wl.tensor_dtype(t.name) in TARGET.dtypes for t in wl.op.outputs)]


def _run(kernel):
    return lambda inputs, outputs, params: kernel.run(inputs, outputs, params)


def _check_then_replay(wl, kernel, seed: int) -> None:
    """The kernel against the reference on two seeds; then, on a third seed's inputs, a CUDA graph of
    one call replayed into zeroed outputs must rewrite exactly what the eager call wrote."""
    for s in (seed, seed + 1):
        for c in check(wl, _run(kernel), s, DEVICE):
            assert c.ok, (c, s)
    inputs = {k: v.to(DEVICE) for k, v in wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(seed + 2)).items()}
    out = poisoned(wl, wl.dim, DEVICE)
    kernel.run(inputs, out, wl.op.params)
    eager = {k: v.clone() for k, v in out.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel.run(inputs, out, wl.op.params)
    for v in out.values():
        v.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for k, v in out.items():
        assert torch.equal(v, eager[k]), k


@pytest.mark.parametrize("wl", CASES, ids=case_id)
def test_default_schedule_on_gpu(wl):
    kernel = flashgen.compile(wl, TARGET, db=None)
    for seed in (0, 1):
        for c in check(wl, _run(kernel), seed, DEVICE):
            assert c.ok, (c, kernel.schedule)


@pytest.mark.parametrize("wl", [w for w in CASES if w.op.kclass == "rowwise" and w.dim.get("N", 0) > 300],
                         ids=case_id)
def test_multi_pass_schedule_on_gpu(wl):
    schedule = {"block_r": min(2, wl.dim["M"]), "block_c": 256, "num_warps": 2}
    assert ScheduleSpace(wl, TARGET).is_valid(schedule)
    kernel = flashgen.compile(wl, TARGET, schedule=schedule)
    for c in check(wl, _run(kernel), 7, DEVICE):
        assert c.ok, c


NATIVE_CASES = [(flashgen.workload("rmsnorm", M=3, N=1000, dtype="bf16"), None),
                (flashgen.workload("gemm", M=17, N=330, K=2048, dtype="bf16", with_bias="yes"),
                 {"block_m": 16, "block_n": 32, "block_k": 64, "num_warps": 4, "num_stages": 3, "group_m": 8, "split_k": 4}),
                (flashgen.workload("gemm_w4a16", M=1, N=330, K=1024, dtype="fp16", G=128), None),
                (flashgen.workload("paged_decode_attention", B=3, Hq=8, Hkv=2, D=128, BS=16, NB=64, MAXB=8, L=100,
                                   dtype="bf16"), None)]


@pytest.mark.parametrize("wl, s", NATIVE_CASES, ids=lambda v: case_id(v) if hasattr(v, "op") else str(bool(v)))
def test_native_launch_matches_tritons_launcher(wl, s, monkeypatch):
    """The native launch writes exactly what Triton's launcher of the same binary writes (a split-K
    kernel with its scratch, programmatic dependent launch, an attention kernel); so does a bound call
    after its inputs change, and a launch from a thread that has made no CUDA call."""
    import threading

    native = flashgen.compile(wl, TARGET, schedule=s, db=None)
    monkeypatch.setenv("FLASHGEN_NATIVE_LAUNCH", "0")
    tritons = flashgen.compile(wl, TARGET, schedule=s, db=None)
    gen = torch.Generator().manual_seed(21)
    inputs = {k: v.to(DEVICE) for k, v in wl.op.make_inputs(wl.dim, wl.attr, gen).items()}
    want, got = poisoned(wl, wl.dim, DEVICE), poisoned(wl, wl.dim, DEVICE)
    tritons.run(inputs, want)
    monkeypatch.delenv("FLASHGEN_NATIVE_LAUNCH")
    native.run(inputs, got)
    assert native.launcher._native is not None and tritons.launcher._native is None
    for k in want:
        assert torch.equal(got[k], want[k]), k
    bound = native.bind(inputs, got)
    fresh = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(22))
    for k, v in inputs.items():
        v.copy_(fresh[k])
    tritons.run(inputs, want)
    for v in got.values():
        v.zero_()
    bound()
    torch.cuda.synchronize()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for v in got.values():
        v.zero_()
    torch.cuda.synchronize()
    errors: list[BaseException] = []
    def launch() -> None:
        try:
            native.run(inputs, got)
            torch.cuda.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
    worker = threading.Thread(target=launch)
    worker.start()
    worker.join()
    assert not errors, errors
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_row_count_differs_from_compiled():
    wl = flashgen.workload("rmsnorm", M=64, N=4096, dtype="bf16")
    kernel = flashgen.compile(wl, TARGET)
    for m in (1, 63, 1000):
        for c in check(wl.with_dims(M=m), _run(kernel), m, DEVICE):
            assert c.ok, (m, c)


GEMM_CASES = [flashgen.workload(op, M=m, N=320, K=512, dtype=dt, **kw)
              for m in (1, 17, 256, 2100) for dt in ("bf16", "fp16")
              for op, kw in (("gemm", {}), ("gemm_w8a16", {}), ("gemm_w4a16", {"G": 128}),
                             ("gemm_w4a16", {"G": 512, "group": "channel", "zp": "asym"}),
                             ("gemm_w4a16", {"G": 64, "zp": "asym"}), ("gemm_w8a8", {}),
                             ("gemm_fp8", {}), ("gemm", {"with_bias": "yes", "act": "silu", "with_residual": "yes"}),
                             ("gemm_w4a8", {"G": 128}), ("gemm_w4a8", {"G": 512, "group": "channel", "with_bias": "yes"}),
                             ("gemm_w4a8", {"G": 128, "pack": "lanes"}),
                             ("gemm_w4a8", {"G": 512, "group": "channel", "pack": "lanes", "with_residual": "yes"}))
              if op != "gemm_fp8" or "fp8e4m3" in TARGET.dtypes]


@pytest.mark.parametrize("wl", GEMM_CASES, ids=case_id)
def test_gemm_on_gpu(wl):
    """bf16 GEMMs are checked here only: Triton's interpreter multiplies bf16 dot operands wrongly.
    At M=2100 the quantized ops' defaults dequantize the weight first."""
    kernel = flashgen.compile(wl, TARGET)
    for c in check(wl, _run(kernel), 1, DEVICE):
        assert c.ok, (c, kernel.schedule)


W4FP8_CASES = [flashgen.workload("gemm_w4fp8", M=m, N=330, K=k, dtype=dt, **kw)
               for m, k, kw, dt in ((1, 1024, {"G": 128}, "bf16"), (3, 576, {"G": 64}, "fp16"), (17, 1024, {"G": 128}, "bf16"),
                                    (256, 576, {"G": 576, "group": "channel", "with_residual": "yes"}, "bf16"))]


@pytest.mark.skipif("fp8e4m3" not in TARGET.dtypes, reason="e4m3 tensor cores: sm_90")
@pytest.mark.parametrize("wl", W4FP8_CASES, ids=case_id)
def test_w4fp8_every_form_on_gpu(wl):
    """gemm_w4fp8 in every form its space offers, the PTX-unpacked ones too (the interpreter runs no
    inline PTX), with row (M=3, 17), column (N=330) and k (K=576: 4.5 blocks of 128) tails."""
    space = ScheduleSpace(wl, TARGET)
    for form, s in form_schedules(space).items():
        kernel = flashgen.compile(wl, TARGET, schedule=s)
        for c in check(wl, _run(kernel), 5, DEVICE):
            assert c.ok, (form, c, s)


@pytest.mark.skipif("fp8e4m3" not in TARGET.dtypes, reason="e4m3 tensor cores: sm_90")
@pytest.mark.parametrize("m", [3, 300])
def test_fp8_gemm_k_tail_on_gpu(m):
    """e4m3 loads zero-filled past K (K = 200 under 64- and 128-deep k steps)."""
    wl = flashgen.workload("gemm_fp8", M=m, N=320, K=200, dtype="bf16")
    for c in check(wl, _run(flashgen.compile(wl, TARGET)), 2, DEVICE):
        assert c.ok, c


GEMV_CASES = [(flashgen.workload("gemm_w4a16", M=3, N=330, K=1024, dtype=dt, **kw), bm, bk)
              for dt in ("bf16", "fp16") for kw in ({"G": 128}, {"G": 1024, "group": "channel", "zp": "asym"})
              for bm, bk in ((1, 1024), (2, 256), (4, 128))] + [
    (flashgen.workload("gemm", M=3, N=330, K=1000, dtype="bf16"), bm, bk) for bm, bk in ((1, 1024), (2, 512))]


@pytest.mark.parametrize("wl, block_m, block_k", GEMV_CASES, ids=lambda v: case_id(v) if hasattr(v, "op") else str(v))
@pytest.mark.parametrize("stages", [3, 1])
def test_gemv_tiles_on_gpu(wl, block_m, block_k, stages):
    """ALU tiles of 1-4 rows, pipelined or loading straight into registers (1 stage), with partial row
    (M=3), column (N=330) and, for bf16 weights, k (K=1000) tiles."""
    s = {"block_m": block_m, "block_n": 32, "block_k": block_k, "num_warps": 2, "num_stages": stages, "group_m": 1}
    kernel = flashgen.compile(wl, TARGET, schedule=s)
    for c in check(wl, _run(kernel), 3, DEVICE):
        assert c.ok, (c, s)


@pytest.mark.parametrize("wl", [GEMV_CASES[0][0], flashgen.workload("gemm", M=1, N=330, K=1000, dtype="bf16",
                                                                  with_residual="yes")], ids=case_id)
def test_gemv_early_load_on_gpu(wl):
    """Early weight loads (before the wait for the previous kernel), each GEMV fed by a generated RMSNorm
    that writes its x into one buffer: 16 pairs launched back to back (programmatic dependent launch on
    sm_90), outputs checked after one synchronize. A GEMV that read x before its RMSNorm ended would
    see the previous pair's x."""
    s = {"block_m": 1, "block_n": 16, "block_k": 256, "num_warps": 2, "num_stages": 3, "group_m": 1, "early_load": 1}
    if not ScheduleSpace(wl, TARGET).is_valid(s):
        pytest.skip(f"{TARGET.key}: {ScheduleSpace(wl, TARGET).why_invalid(s)}")
    gemv = flashgen.compile(wl, TARGET, schedule=s)
    k = wl.dim["K"]
    norm = flashgen.compile(flashgen.workload("rmsnorm", M=wl.dim["M"], N=k, dtype=wl.attr["dtype"]), TARGET)
    gen = torch.Generator().manual_seed(11)
    inputs = {n: t.to(DEVICE) for n, t in wl.op.make_inputs(wl.dim, wl.attr, gen).items()}
    dt = inputs["x"].dtype
    rows = [torch.randn(wl.dim["M"], k, generator=gen).to(dt).to(DEVICE) for _ in range(16)]
    gain = torch.rand(k, generator=gen).to(dt).to(DEVICE) + 0.5
    x = torch.empty_like(inputs["x"])
    outs = []
    for row in rows:
        norm.run({"x": row, "w": gain}, {"y": x})
        outs.append(gemv.run({**inputs, "x": x})[wl.op.outputs[0].name])
    torch.cuda.synchronize()
    for row, out in zip(rows, outs):
        want = wl.op.reference({**{n: t.cpu() for n, t in inputs.items()},
                                "x": norm.run({"x": row, "w": gain})["y"].cpu()}, wl.op.params, wl.dim, wl.attr)
        ref = next(iter(want.values()))
        assert torch.allclose(out.double().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()), (out, ref)


GEMV_PAIR_CASES = [flashgen.workload("gemm_w4a16", M=m, N=330, K=1152, dtype=dt, **kw) for dt in ("bf16", "fp16")
                   for kw in ({"G": 128}, {"G": 128, "zp": "asym"}) for m in (1, 3)]


@pytest.mark.parametrize("wl", GEMV_PAIR_CASES, ids=case_id)
@pytest.mark.parametrize("block_m, early", [(1, 0), (2, 1), (4, 0)])
@pytest.mark.parametrize("unpack, warps", [(1, 4), (2, 4), (2, 2)])
@pytest.mark.parametrize("stages", [3, 1])
def test_int4_gemv_pairs_on_gpu(wl, block_m, early, unpack, warps, stages):
    """int4 GEMV tiles in fp16 pairs (inline PTX), one dot per word or per quad of words: K=1152 leaves
    a partial k step of 512, N=330 a partial column tile; with and without early weight loads, with
    and without a copy pipeline."""
    s = {"block_m": block_m, "block_n": 16, "block_k": 512, "num_warps": warps, "num_stages": stages, "group_m": 1,
         "ptx_unpack": unpack, "early_load": early}
    if not ScheduleSpace(wl, TARGET).is_valid(s):
        pytest.skip(f"{TARGET.key}: {ScheduleSpace(wl, TARGET).why_invalid(s)}")
    kernel = flashgen.compile(wl, TARGET, schedule=s)
    for c in check(wl, _run(kernel), 21, DEVICE):
        assert c.ok, (c, s)


PTX_CASES = [flashgen.workload("gemm_w4a16", M=m, N=330, K=1152, dtype=dt, **kw)
             for dt in ("bf16", "fp16") for kw in ({"G": 128}, {"G": 64, "zp": "asym"}, {"G": 128, "zp": "asym"})
             for m in (1, 17, 100)]


@pytest.mark.parametrize("wl", PTX_CASES, ids=case_id)
@pytest.mark.parametrize("block_k", [128, 256])
@pytest.mark.parametrize("oscale", [0, 1])
def test_int4_ptx_unpack_on_gpu(wl, block_k, oscale):
    """int4 matrix tiles unpacked by inline PTX (two codes per AND-OR), with the group scale applied to
    the accumulated groups or to the operand (`operand_scale`), partial row, column and k tiles
    (K=1152 leaves half a 256-deep step), one row of sixteen (M=1) too."""
    s = {"block_m": 16 if wl.dim["M"] < 64 else 64, "block_n": 64, "block_k": block_k, "num_warps": 4,
         "num_stages": 3, "group_m": 8, "ptx_unpack": 1, "operand_scale": oscale}
    if not ScheduleSpace(wl, TARGET).is_valid(s):
        pytest.skip(f"{TARGET.key}: {ScheduleSpace(wl, TARGET).why_invalid(s)}")
    kernel = flashgen.compile(wl, TARGET, schedule=s)
    for c in check(wl, _run(kernel), 15, DEVICE):
        assert c.ok, (c, s)


K576_CASES = [flashgen.workload(op, M=m, N=330, K=576, G=g, dtype=dt, **kw)
              for op, kw in INT4_K576_OPS for g in (64, 32) for m, dt in ((1, "bf16"), (5, "fp16"), (16, "bf16"), (600, "bf16"))]


@pytest.mark.parametrize("wl", K576_CASES, ids=case_id)
def test_int4_groups_of_k576_on_gpu(wl):
    """K = 576 (4.5 blocks of 128 k) in groups of 64 and 32, as the decoder quantizes such a linear:
    one schedule of every form the space offers (PTX-unpacked matrix tiles, lanes tiles, a weight
    dequantized first, Gluon tiles on it), the default among them, against the float64 reference."""
    space = ScheduleSpace(wl, TARGET)
    default = space.default()
    for s in [default] + [s for s in form_schedules(space).values() if s != default]:
        kernel = flashgen.compile(wl, TARGET, schedule=s)
        for c in check(wl, _run(kernel), 576, DEVICE):
            assert c.ok, (c, s)


SPLIT_CASES = [(flashgen.workload(op, M=m, N=330, K=2048, dtype="bf16", **kw), bm, split)
               for op, kw in (("gemm", {"with_bias": "yes", "act": "silu"}), ("gemm_w4a16", {"G": 128}), ("gemm_w8a8", {}),
                              ("gemm_w4a8", {"G": 64}))
               for m, bm, split in ((1, 1, 4), (17, 16, 2), (256, 64, 8)) if op not in ("gemm_w8a8", "gemm_w4a8") or bm >= 16]


@pytest.mark.parametrize("wl, block_m, split_k", SPLIT_CASES, ids=lambda v: case_id(v) if hasattr(v, "op") else str(v))
def test_split_k_on_gpu(wl, block_m, split_k):
    """Split-K tiles, run twice with the same kernel: the last split of each tile merges and resets
    its counter, so the second call starts clean."""
    s = {"block_m": block_m, "block_n": 32, "block_k": 128 if wl.op_name in ("gemm_w4a16", "gemm_w4a8") else 64,
         "num_warps": 4 if block_m >= 16 else 2, "num_stages": 3, "group_m": 8, "split_k": split_k}
    kernel = flashgen.compile(wl, TARGET, schedule=s)
    for seed in (4, 5):
        for c in check(wl, _run(kernel), seed, DEVICE):
            assert c.ok, (c, s, seed)


@pytest.mark.parametrize("k, block_k, split_k", [(4096, 2048, 2), (4096, 1024, 4), (3968, 2048, 2)])
@pytest.mark.parametrize("m, dt", [(1, "fp16"), (3, "bf16")])
def test_split_one_stage_gemv_on_gpu(k, block_k, split_k, m, dt):
    """One-stage PTX-quad GEMV tiles split along K into single deep steps (K=3968: the last split's
    step partial), run twice so that each tile's counter is reset by its merge."""
    wl = flashgen.workload("gemm_w4a16", M=m, N=330, K=k, G=128, dtype=dt)
    s = {"block_m": 1, "block_n": 16, "block_k": block_k, "num_warps": 4, "num_stages": 1, "group_m": 1,
         "ptx_unpack": 2, "split_k": split_k}
    assert ScheduleSpace(wl, TARGET).is_valid(s), ScheduleSpace(wl, TARGET).why_invalid(s)
    kernel = flashgen.compile(wl, TARGET, schedule=s)
    for seed in (31, 32):
        for c in check(wl, _run(kernel), seed, DEVICE):
            assert c.ok, (c, s, seed)


@pytest.mark.parametrize("op, kw", [("gemm", {"with_residual": "yes"}), ("gemm_w8a8", {}), ("gemm_w4a16", {"G": 128})],
                         ids=["gemm", "w8a8", "w4a16"])
def test_persistent_tiles_on_gpu(op, kw):
    """Persistent programs, one per SM, walking more tiles than there are SMs; run twice."""
    wl = flashgen.workload(op, M=1000, N=1000, K=512, dtype="bf16", **kw)
    s = {"block_m": 64, "block_n": 64, "block_k": 128 if op == "gemm_w4a16" else 64, "num_warps": 4, "num_stages": 3,
         "group_m": 8, "split_k": 1, "persistent": 1}
    kernel = flashgen.compile(wl, TARGET, schedule=s)
    for seed in (6, 7):
        for c in check(wl, _run(kernel), seed, DEVICE):
            assert c.ok, (c, seed)


@pytest.mark.parametrize("op, kw", [("gemm", {"with_bias": "yes", "act": "silu"}), ("gemm_w8a8", {}), ("gemm_fp8", {})],
                         ids=["gemm", "w8a8", "fp8"])
def test_tma_tiles_on_gpu(op, kw):
    """A and W tiles copied by TMA (descriptors built on the device in launch scratch), tails on every
    side, twice; then replayed from a CUDA graph captured with a different input."""
    if ScheduleSpace(flashgen.workload("gemm", M=16, N=64, K=64), TARGET).values("tma") == (0,):
        pytest.skip("no TMA on this GPU's target")
    if op == "gemm_fp8" and "fp8e4m3" not in TARGET.dtypes:
        pytest.skip("no fp8 on this target")
    wl = flashgen.workload(op, M=300, N=1000, K=1024 if op == "gemm_fp8" else 1040, dtype="bf16", **kw)
    s = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3, "group_m": 8, "tma": 1}
    _check_then_replay(wl, flashgen.compile(wl, TARGET, schedule=s), 12)


GLUON_CASES = [("gemm", {"with_bias": "yes", "act": "silu"}, "bf16"), ("gemm", {"with_residual": "yes", "act": "gelu"}, "fp16"),
               ("gemm_w8a8", {}, "bf16"), ("gemm_fp8", {}, "bf16")]
GLUON_TILES = [(64, 128, 64, 4, 3, 0, 0), (64, 128, 64, 4, 4, 1, 1), (128, 256, 64, 8, 3, 2, 1), (128, 128, 64, 8, 2, 0, 1),
               (128, 256, 64, 8, 3, 1, 0)]


@pytest.mark.parametrize("op, kw, dt", GLUON_CASES, ids=["gemm-bias-silu", "gemm-residual-gelu", "w8a8", "fp8"])
@pytest.mark.parametrize("tile", GLUON_TILES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("m", [100, 300])
def test_gluon_tiles_on_gpu(op, kw, dt, tile, m):
    """Gluon tiles (TMA ring, mbarriers, warpgroup MMA; with no producer warp, with one, with one and
    persistent programs; one and two warpgroups; stores per thread or by TMA): tails on every side
    (N=1000, K=1040 under 64- and 128-deep steps, M=100 and 300), twice; then replayed from a CUDA
    graph captured with a different input."""
    wl = flashgen.workload(op, M=m, N=1000, K=1024 if op == "gemm_fp8" else 1040, dtype=dt, **kw)
    space = ScheduleSpace(wl, TARGET)
    if space.values("backend") == (0,):
        pytest.skip("the Gluon tiles build for sm_90")
    bm, bn, bk, warps, stages, walk, tma_store = tile
    bk = 128 if op != "gemm" else bk  # 1-byte operands: 128 bytes per row of a k step too
    bn = min(bn, 128) if op == "gemm_w8a8" else bn  # (int8 tiles: at most 128 columns)
    s = {**space.flat(space.default()), "block_m": bm, "block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages,
         "group_m": 8, "split_k": 1, "persistent": int(walk == 2), "tma": 0, "early_load": 0, "backend": 1,
         "producer_warps": int(walk > 0), "tma_store": tma_store}
    assert space.is_valid(s), space.why_invalid(s)
    _check_then_replay(wl, flashgen.compile(wl, TARGET, schedule=s), 17)


PINGPONG_TILES = [(64, 128, 64, 4, 0), (64, 256, 64, 3, 1), (128, 128, 64, 4, 1)]


@pytest.mark.parametrize("op, kw, dt", GLUON_CASES, ids=["gemm-bias-silu", "gemm-residual-gelu", "w8a8", "fp8"])
@pytest.mark.parametrize("tile", PINGPONG_TILES, ids=lambda t: "x".join(map(str, t)))
def test_gluon_consumers_take_turns_on_gpu(op, kw, dt, tile):
    """Two consumer warpgroups taking turns at a persistent program's tiles (M=2500: more tiles than
    programs, so every program has tiles for both, with a row tail; k steps beyond the ring's stages,
    so the turns decide which phase of a slot each consumer awaits)."""
    wl = flashgen.workload(op, M=2500, N=1000, K=1024 if op == "gemm_fp8" else 1040, dtype=dt, **kw)
    space = ScheduleSpace(wl, TARGET)
    if space.values("backend") == (0,):
        pytest.skip("the Gluon tiles build for sm_90")
    bm, bn, bk, stages, tma_store = tile
    bk = 128 if op != "gemm" else bk
    bn = min(bn, 128) if op == "gemm_w8a8" else bn
    s = {**space.flat(space.default()), "block_m": bm, "block_n": bn, "block_k": bk, "num_warps": 4, "num_stages": stages,
         "group_m": 8, "split_k": 1, "persistent": 1, "tma": 0, "early_load": 0, "backend": 1, "producer_warps": 1,
         "tma_store": tma_store, "consumers": 2}
    assert space.is_valid(s), space.why_invalid(s)
    _check_then_replay(wl, flashgen.compile(wl, TARGET, schedule=s), 17)


STAGED_CASES = [("gemm_w4a16", {"G": 128}, 1152, 1), ("gemm_w4a16", {"G": 80, "zp": "asym", "with_residual": "yes"}, 1040, 0),
                ("gemm_w4a16", {"G": 1040, "group": "channel"}, 1040, 1), ("gemm_w8a16", {"with_bias": "yes"}, 1040, 1),
                ("gemm_w4a8", {"G": 128}, 1152, 1), ("gemm_w4a8", {"G": 128, "pack": "lanes"}, 1152, 1)]


LANES_CASES = [  # (M, N, K, G or None per channel, schedule knobs besides the tile's)
    (1, 330, 4096, 128, {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "split_k": 4}),
    (17, 1000, 1056, 352, {"block_m": 32, "block_n": 64, "block_k": 32, "num_warps": 4, "split_k": 2}),
    (17, 1000, 1152, 128, {"block_m": 32, "block_n": 64, "block_k": 256, "num_warps": 4, "split_k": 1}),
    (256, 4096, 4096, 128, {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8, "group_m": 8}),
    (600, 960, 1088, 64, {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 8, "persistent": 1}),
    (300, 1000, 1000, None, {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 4, "group_m": 8}),
]


# each case in the lanes tile, and where it has groups with their scales in the lanes
LANES_FORMS = [(*c, f) for c in LANES_CASES for f in ("tile_lanes", "tile_lanes_scaled") if c[3] or f == "tile_lanes"]


@pytest.mark.parametrize("m, n, k, g, knobs, form", LANES_FORMS,
                         ids=[f"{c[0]}x{c[1]}x{c[2]}-g{c[3]}-{c[5]}" for c in LANES_FORMS])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_lanes_tiles_on_gpu(m, n, k, g, knobs, form, dt):
    """gemm_w4a8's `lanes` tiles (four int8 lanes per AND, a group's int32 sum times its integer scale;
    or, tile_lanes_scaled, the scale in the lanes, one int32 sum): every group mode, tails on every
    side, split and persistent, twice, then replayed from a CUDA graph."""
    wl = flashgen.workload("gemm_w4a8", M=m, N=n, K=k, G=g or k, dtype=dt, group="group" if g else "channel",
                           pack="lanes")
    space = ScheduleSpace(wl, TARGET)
    s = {"variant": form, "num_stages": 3, "group_m": 1, "split_k": 1, "persistent": 0, **knobs}
    s = {key: v for key, v in s.items() if key == "variant" or key in space.forms()[form]}
    assert space.is_valid(s), space.why_invalid(s)
    _check_then_replay(wl, flashgen.compile(wl, TARGET, schedule=s), 43)


GLUON_LANES_CASES = [  # (M, N, K, G or None per channel, schedule knobs besides the tile's)
    (1, 330, 4096, 128, {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "split_k": 4}),
    (17, 1000, 1152, 64, {"block_m": 32, "block_n": 64, "block_k": 128, "num_warps": 4, "split_k": 2}),
    (17, 1000, 1088, 32, {"block_m": 16, "block_n": 64, "block_k": 256, "num_warps": 4}),  # K: 4 steps and a quarter
    (256, 4096, 4096, 128, {"block_m": 128, "block_n": 128, "block_k": 128, "num_warps": 8}),
    (600, 960, 1088, 64, {"block_m": 128, "block_n": 64, "block_k": 64, "num_warps": 4, "split_k": 2}),
    (300, 1000, 1008, None, {"block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4}),
]


@pytest.mark.parametrize("m, n, k, g, knobs", GLUON_LANES_CASES,
                         ids=[f"{c[0]}x{c[1]}x{c[2]}-g{c[3]}" for c in GLUON_LANES_CASES])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_gluon_lanes_tiles_on_gpu(m, n, k, g, knobs, dt):
    """gemm_w4a8's Gluon lanes tiles (bytes and int8 activations by TMA, two blocks' codes unpacked with
    their group scales into int8 warpgroup MMAs' register operands): groups of 32-128 k and per
    channel, tails on every side (N=330 and 1000, K not whole k steps), split K, twice, then replayed
    from a CUDA graph."""
    wl = flashgen.workload("gemm_w4a8", M=m, N=n, K=k, G=g or k, dtype=dt, group="group" if g else "channel",
                           pack="lanes")
    space = ScheduleSpace(wl, TARGET)
    if "gluon_lanes" not in space.forms():
        pytest.skip("the Gluon tiles build for sm_90")
    s = {"variant": "gluon_lanes", "num_stages": 3, "group_m": 8, "split_k": 1, **knobs}
    s = {key: v for key, v in s.items() if key == "variant" or key in space.forms()["gluon_lanes"]}
    assert space.is_valid(s), space.why_invalid(s)
    _check_then_replay(wl, flashgen.compile(wl, TARGET, schedule=s), 53)


@pytest.mark.parametrize("op, kw, k, tma", STAGED_CASES, ids=[f"{o}-{len(kw)}-tma{t}" for o, kw, _, t in STAGED_CASES])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_dequant_first_on_gpu(op, kw, k, tma, dt, chunks):
    """A weight dequantized by its own kernel, then the dense GEMM on it (TMA tiles where the target
    has them), whole or in 4 chunks overlapped on two streams; tails on every side (M=600, N=1000 or
    960 = 4 x 240 under 128-column tiles, K=1040 under 64-deep k steps), twice; then replayed from a
    CUDA graph captured with a different input."""
    wl = flashgen.workload(op, M=600, N=1000 if chunks == 1 else 960, K=k, dtype=dt, **kw)
    tma = tma if ScheduleSpace(wl, TARGET).values("tma") != (0,) else 0
    s = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3, "group_m": 8, "tma": tma,
         "dequant_first": 1, "dequant_chunks": chunks}
    assert ScheduleSpace(wl, TARGET).is_valid(s), ScheduleSpace(wl, TARGET).why_invalid(s)
    _check_then_replay(wl, flashgen.compile(wl, TARGET, schedule=s), 41)


@pytest.mark.parametrize("op, kw, k, tma", STAGED_CASES, ids=[f"{o}-{len(kw)}-tma{t}" for o, kw, _, t in STAGED_CASES])
@pytest.mark.parametrize("consumers", [1, 2])
def test_dequant_first_gluon_on_gpu(op, kw, k, tma, consumers):
    """The dense GEMM on a weight dequantized first, as a Gluon tile (one persistent consumer with a
    producer warp, or two taking turns), in one chunk (the space's rule); the same tails and replay."""
    wl = flashgen.workload(op, M=600, N=960, K=k, dtype="fp16", **kw)
    space = ScheduleSpace(wl, TARGET)
    if space.values("backend") == (0,):
        pytest.skip("the Gluon tiles build for sm_90")
    s = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4, "group_m": 8, "backend": 1,
         "producer_warps": 1, "persistent": 1, "consumers": consumers, "dequant_first": 1, "dequant_chunks": 1}
    assert space.is_valid(s), space.why_invalid(s)
    _check_then_replay(wl, flashgen.compile(wl, TARGET, schedule=s), 43)


INT4_GLUON_CASES = [  # (M, K, the op's attrs, block_m, block_n, warps, stages, split_k)
    (1, 1152, {"G": 128, "dtype": "bf16"}, 16, 64, 4, 4, 1),
    (19, 1152, {"G": 128, "dtype": "fp16", "with_residual": "yes"}, 16, 64, 4, 4, 4),  # 9 k steps in 4 splits
    (64, 1152, {"G": 128, "dtype": "bf16", "with_bias": "yes", "act": "silu"}, 64, 128, 8, 3, 2),
    (300, 1280, {"G": 256, "dtype": "bf16"}, 128, 128, 8, 3, 1),
    (300, 1152, {"G": 1152, "group": "channel", "dtype": "fp16", "with_bias": "yes"}, 256, 64, 4, 2, 1),
    (1000, 1152, {"G": 128, "dtype": "fp16"}, 256, 128, 8, 2, 1),
    (256, 1152, {"G": 128, "dtype": "bf16"}, 128, 128, 8, 4, 2),
]


@pytest.mark.parametrize("case", INT4_GLUON_CASES, ids=lambda c: f"M{c[0]}-" + "x".join(map(str, c[3:])))
def test_gluon_int4_tiles_on_gpu(case):
    """Gluon int4 tiles (packed words and activations by TMA, codes unpacked into the warpgroup
    MMA's register operand, group scales in the operand or per-channel scales on the sum, split K):
    one row, tails on every side (N=1000 under 64- and 128-row weight tiles), twice; then replayed
    from a CUDA graph captured with a different input."""
    m, k, kw, bm, bn, warps, stages, split = case
    wl = flashgen.workload("gemm_w4a16", M=m, N=1000, K=k, **kw)
    space = ScheduleSpace(wl, TARGET)
    if space.values("backend") == (0,):
        pytest.skip("the Gluon tiles build for sm_90")
    s = {"block_m": bm, "block_n": bn, "block_k": 128, "num_warps": warps, "num_stages": stages, "group_m": 8,
         "split_k": split, "backend": 1, "producer_warps": 1, "ptx_unpack": 1,
         "operand_scale": int(kw.get("group") != "channel")}
    assert space.is_valid(s), space.why_invalid(s)
    _check_then_replay(wl, flashgen.compile(wl, TARGET, schedule=s), 47)


ATTN_CASES = [flashgen.workload("paged_decode_attention", B=b, Hq=hq, Hkv=hkv, D=d, BS=16, NB=512, MAXB=64,
                                L=length, dtype=dt, mod=mod)
              for b, length in ((1, 1000), (7, 333)) for hq, hkv, d in ((32, 8, 128), (8, 8, 64), (16, 2, 256))
              for dt in ("bf16", "fp16") for mod in ("none", "alibi")]


@pytest.mark.parametrize("wl", ATTN_CASES, ids=case_id)
def test_paged_decode_on_gpu(wl):
    kernel = flashgen.compile(wl, TARGET)
    for c in check(wl, _run(kernel), 2, DEVICE, params={"window": 100.0}):
        assert c.ok, (c, kernel.schedule)


PREFILL_CASES = [flashgen.workload("flash_prefill_attention", T=t, B=b, Hq=32, Hkv=8, D=d, dtype=dt, mod=mod)
                 for t, b in ((1000, 1), (3001, 7)) for d in (64, 128) for dt in ("bf16", "fp16")
                 for mod in ("none", "window")]


@pytest.mark.parametrize("wl", PREFILL_CASES, ids=case_id)
def test_prefill_on_gpu(wl):
    kernel = flashgen.compile(wl, TARGET)
    for c in check(wl, _run(kernel), 3, DEVICE, params={"window": 256.0}):
        assert c.ok, (c, kernel.schedule)


@pytest.mark.parametrize("wl", [w for w in PREFILL_CASES if w.attr["dtype"] == "bf16"], ids=case_id)
def test_prefill_tma_tiles_on_gpu(wl):
    """Key and value tiles by TMA descriptors (sm_90), the 128 x 128 tile the prefill sweeps kept."""
    if TARGET.capability < 90:
        pytest.skip("TMA needs sm_90")
    kernel = flashgen.compile(wl, TARGET, schedule={"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3,
                                                    "tma": 1})
    for c in check(wl, _run(kernel), 3, DEVICE, params={"window": 256.0}):
        assert c.ok, (c, kernel.schedule)


GLUON_PREFILL = {"pingpong": {"block_m": 128, "block_n": 64, "num_stages": 3, "consumers": 2, "pingpong": 1},
                 "two": {"block_m": 128, "block_n": 128, "num_stages": 2, "consumers": 2, "pingpong": 0},
                 "one": {"block_m": 64, "block_n": 128, "num_stages": 2, "consumers": 1, "pingpong": 0},
                 "pingpong_persistent": {"block_m": 128, "block_n": 64, "num_stages": 3, "consumers": 2, "pingpong": 1,
                                         "persistent": 1},
                 "one_persistent": {"block_m": 64, "block_n": 128, "num_stages": 2, "consumers": 1, "pingpong": 0,
                                    "persistent": 1}}
GLUON_PREFILL_CASES = PREFILL_CASES + [
    flashgen.workload("flash_prefill_attention", T=t, B=b, Hq=hq, Hkv=hkv, D=128, dtype="bf16", mod=mod)
    for t, b, hq, hkv, mod in ((2500, 5, 32, 8, "softcap"), (777, 2, 16, 2, "alibi"), (5, 3, 8, 8, "none"),
                               (1, 1, 4, 1, "none"))]


@pytest.mark.parametrize("wl", GLUON_PREFILL_CASES, ids=case_id)
@pytest.mark.parametrize("form", list(GLUON_PREFILL))
def test_gluon_prefill_on_gpu(wl, form):
    """The Gluon prefill (a copy warp, one or two consumer warpgroups, ping-pong or not, a program per
    tile or persistent programs walking them) against the float64 reference: ragged sequences down to one token, GQA and MHA, every mod; then a CUDA graph."""
    if TARGET.capability != 90:
        pytest.skip("Gluon kernels build for sm_90")
    s = {"num_warps": 4, "tma": 0, "backend": 1, **GLUON_PREFILL[form]}
    assert ScheduleSpace(wl, TARGET).why_invalid(s) is None
    _check_then_replay(wl, flashgen.compile(wl, TARGET, schedule=s), 3)


PADDED_D = ([flashgen.workload("paged_decode_attention", B=3, Hq=16, Hkv=4, D=d, BS=16, NB=256, MAXB=64, L=900,
                               dtype="bf16", kv=kv) for d in (80, 96, 112, 192) for kv in ("same", "fp8e4m3")
              if kv in ("same", *TARGET.dtypes)]
            + [flashgen.workload("flash_prefill_attention", T=1500, B=3, Hq=16, Hkv=4, D=d, dtype="bf16")
               for d in (80, 96, 112, 192, 256)])


@pytest.mark.parametrize("wl", PADDED_D, ids=case_id)
@pytest.mark.parametrize("tma", [0, 1])
def test_padded_head_dims_on_gpu(wl, tma):
    """Head dims that are not a power of two run in tiles padded to the next one, the padding masked
    (TMA boxes fill it with zeros)."""
    space = ScheduleSpace(wl, TARGET)
    s = {**space.default(), **({"tma": tma} if "tma" in space.knobs() else {})}
    if tma and (s.get("tma") != 1 or not space.is_valid(s)):
        pytest.skip("no TMA tiles for this workload and target")
    kernel = flashgen.compile(wl, TARGET, schedule=s)
    params = {k: v for k, v in {"k_scale": 0.5, "v_scale": 2.0}.items() if k in wl.op.params}
    for c in check(wl, _run(kernel), 5, DEVICE, params=params):
        assert c.ok, (c, kernel.schedule)


FP8_KV = [flashgen.workload("paged_decode_attention", B=4, Hq=32, Hkv=8, D=128, BS=16, NB=512, MAXB=64, L=700,
                            dtype=dt, kv="fp8e4m3") for dt in ("bf16", "fp16") if "fp8e4m3" in TARGET.dtypes]


@pytest.mark.parametrize("wl", FP8_KV, ids=case_id)
def test_fp8_kv_cache_on_gpu(wl):
    kernel = flashgen.compile(wl, TARGET)
    for c in check(wl, _run(kernel), 4, DEVICE, params={"k_scale": 0.5, "v_scale": 2.0}):
        assert c.ok, (c, kernel.schedule)


@pytest.mark.parametrize("splits", [4, 32])
def test_split_kv_decode_on_gpu(splits):
    """Flash-decoding: programs of one sequence race to merge; repeated launches reuse the counters."""
    wl = flashgen.workload("paged_decode_attention", B=2, Hq=32, Hkv=8, D=128, BS=16, NB=2048, MAXB=1300, L=20000,
                           dtype="bf16")
    kernel = flashgen.compile(wl, TARGET, schedule={"pages": 2, "num_warps": 4, "num_stages": 2, "splits": splits})
    for seed in range(3):
        for c in check(wl, _run(kernel), 10 + seed, DEVICE):
            assert c.ok, (c, kernel.schedule)


@pytest.mark.parametrize("splits", [1, 4])
def test_early_kv_decode_on_gpu(splits):
    """Early cache reads (before the wait for the previous kernel), each decode attention fed by a
    generated rope_cache that writes the query and the newest key and value: 16 decode steps of three
    sequences launched back to back, checked after one synchronize. The newest slots and the query
    buffers start poisoned, so an attention that read either before its rope_cache ended would see it."""
    wl = flashgen.workload("paged_decode_attention", B=3, Hq=32, Hkv=8, D=128, BS=16, NB=64, MAXB=16, L=256,
                           dtype="bf16")
    s = {"pages": 2, "num_warps": 4, "num_stages": 2, "splits": splits, "early_kv": 1}
    if not ScheduleSpace(wl, TARGET).is_valid(s):
        pytest.skip(f"{TARGET.key}: {ScheduleSpace(wl, TARGET).why_invalid(s)}")
    attn = flashgen.compile(wl, TARGET, schedule=s)
    d = wl.dim
    rope_wl = flashgen.workload("rope_cache", M=d["B"], Hq=d["Hq"], Hkv=d["Hkv"], D=d["D"], L=d["L"],
                                NS=d["NB"] * d["BS"], dtype="bf16")
    rope = flashgen.compile(rope_wl, TARGET)
    gen = torch.Generator().manual_seed(17)
    ins = {n: t.to(DEVICE) for n, t in wl.op.make_inputs(d, wl.attr, gen).items()}
    cos_sin = rope_wl.op.make_inputs(rope_wl.dim, rope_wl.attr, gen)["cos_sin"].to(DEVICE)
    kc, vc, tables = ins["k_cache"], ins["v_cache"], ins["block_tables"]
    base = torch.tensor([0, 50, 200], device=DEVICE)
    steps = []
    for r in range(16):
        pos = base + r
        slots = tables[torch.arange(3, device=DEVICE), pos // d["BS"]].long() * d["BS"] + pos % d["BS"]
        kc.view(-1, d["Hkv"], d["D"])[slots] = 100.0  # poisoned until this step's rope_cache writes them
        vc.view(-1, d["Hkv"], d["D"])[slots] = 100.0
        steps.append({"positions": pos, "slots": slots, "ctx": (pos + 1).to(torch.int32),
                      "q": torch.randn(3, d["Hq"], d["D"], generator=gen).to(torch.bfloat16).to(DEVICE),
                      "k": torch.randn(3, d["Hkv"], d["D"], generator=gen).to(torch.bfloat16).to(DEVICE),
                      "v": torch.randn(3, d["Hkv"], d["D"], generator=gen).to(torch.bfloat16).to(DEVICE),
                      "q_out": torch.full((3, d["Hq"], d["D"]), 100.0, dtype=torch.bfloat16, device=DEVICE),
                      "k_out": torch.empty(3, d["Hkv"], d["D"], dtype=torch.bfloat16, device=DEVICE)})
    torch.cuda.synchronize()
    outs = []
    for st in steps:
        rope.run({"q": st["q"], "k": st["k"], "positions": st["positions"], "cos_sin": cos_sin, "v": st["v"],
                  "slots": st["slots"], "k_cache": kc.view(-1, d["Hkv"], d["D"]),
                  "v_cache": vc.view(-1, d["Hkv"], d["D"])}, {"q_out": st["q_out"], "k_out": st["k_out"]})
        outs.append(attn.run({"q": st["q_out"], "k_cache": kc, "v_cache": vc, "block_tables": tables,
                              "context_lens": st["ctx"]})["out"])
    torch.cuda.synchronize()
    cpu = {"k_cache": kc.cpu(), "v_cache": vc.cpu(), "block_tables": tables.cpu()}
    for st, out in zip(steps, outs):
        ref = wl.op.reference({**cpu, "q": st["q_out"].cpu(), "context_lens": st["ctx"].cpu()}, wl.op.params, d,
                              wl.attr)["out"]
        assert torch.allclose(out.double().cpu(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item()), st["positions"]


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
def test_chunked_prefill_on_gpu(dt):
    wl = flashgen.workload("chunked_prefill_attention", T=2000, B=5, Hq=32, Hkv=8, D=128, BS=16, NB=1024, MAXB=128,
                           dtype=dt)
    kernel = flashgen.compile(wl, TARGET)
    for c in check(wl, _run(kernel), 5, DEVICE):
        assert c.ok, (c, kernel.schedule)


GARBAGE_PREFILL = [("flash_prefill_attention", "triton", {}),
                   ("flash_prefill_attention", "triton_tma", {"block_m": 128, "block_n": 128, "num_warps": 8,
                                                              "num_stages": 3, "tma": 1}),
                   *[("flash_prefill_attention", f"gluon_{form}", {"num_warps": 4, "tma": 0, "backend": 1, **s})
                     for form, s in GLUON_PREFILL.items()],
                   ("chunked_prefill_attention", "triton", {}),
                   ("chunked_prefill_attention", "triton_tma", {"block_m": 64, "block_n": 64, "num_warps": 4,
                                                                "num_stages": 2, "tma": 1})]


@pytest.mark.parametrize("op, form, s", GARBAGE_PREFILL, ids=[f"{o.split('_')[0]}-{f}" for o, f, _ in GARBAGE_PREFILL])
@pytest.mark.parametrize("fill", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_prefill_keeps_sequences_apart_on_gpu(op, form, s, fill):
    """A sequence whose new queries, keys and values are NaN (or +inf), and padding rows past the last
    sequence, change no other sequence's output by one bit: the key tiles reaching past a sequence read
    them (a TMA box copies whole rows), and only selection keeps them out (0 x NaN is NaN). Chunked
    prefill's cached prefixes lie in tables padded with block 0, every other cache slot garbage too.
    Each sequence ends inside a tile of 64 and of 128."""
    from tests.garbage import check_both, own_tables, packed
    lens, pad = [300, 1000, 77], 50
    dims = dict(T=sum(lens) + pad, B=3, Hq=16, Hkv=4, D=128, dtype="bf16")
    prefixes, bs = [100, 0, 250], 16
    if op == "chunked_prefill_attention":
        dims.update(BS=bs, NB=40, MAXB=20)
    wl = flashgen.workload(op, **dims)
    if s.get("tma") and TARGET.capability < 90 or s.get("backend") and TARGET.capability != 90:
        pytest.skip("TMA tiles need sm_90, Gluon kernels build for sm_90")
    if s:
        assert ScheduleSpace(wl, TARGET).why_invalid(s) is None
    kernel = flashgen.compile(wl, TARGET, **({"schedule": s} if s else {}))
    g = torch.Generator().manual_seed(9)
    ins, keep, rows = packed(wl, g, lens, pad)
    if op == "chunked_prefill_attention":
        ins["block_tables"], own = own_tables(prefixes, bs, dims["NB"], dims["MAXB"], g)
        ins["prefix_lens"] = torch.tensor(prefixes, dtype=torch.int32)
        keep = {**keep, "k_cache": own, "v_cache": own}
    check_both(wl, lambda t: kernel.run({k: v.to(DEVICE) for k, v in t.items()})["out"].cpu(), ins, keep, fill, rows)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graphs"])
@pytest.mark.parametrize("fill", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_garbage_in_the_cache_changes_no_token_on_gpu(fill, graphs):
    """A KV cache whose every slot (the graphs' pad block included) holds NaN (or +inf) before any
    request gives the tokens of a clean one (bf16, the generated attention): ragged prompts (1 token,
    under, at and over a block), requests joining while others decode, blocks reused, with and without
    CUDA graphs."""
    from flashgen.runtime.decoder.bench import CONFIGS, random_weights
    from flashgen.runtime.decoder.engine import Engine
    from flashgen.runtime.decoder.model import Decoder
    from tests.garbage import check_ragged_runs
    c = CONFIGS["tiny"]
    model = Decoder(c, random_weights(c, torch.bfloat16, DEVICE), DEVICE, torch.bfloat16)
    eng = check_ragged_runs(lambda: Engine(model, num_blocks=10, cuda_graphs=graphs), fill)
    assert model.uses_tables and (eng.graphs is not None) == graphs
    assert not graphs or eng.graphs.graphs  # decode steps were replayed


def test_decoder_on_gpu_matches_its_torch_path():
    """The decoder with generated attention and GEMMs against itself with torch attention (bf16)."""
    from flashgen.runtime.decoder.bench import CONFIGS, random_weights
    from flashgen.runtime.decoder.engine import Engine
    from flashgen.runtime.decoder.sampling import SamplingParams
    from flashgen.runtime.decoder.model import Decoder
    c = CONFIGS["tiny"]
    w = random_weights(c, torch.bfloat16, DEVICE)
    prompts = [[1, 2, 3, 4, 5] * 7, [9] * 3, list(range(100))]
    outs = []
    for generated in (True, False):
        model = Decoder(c, w, DEVICE, torch.bfloat16)
        model.generated_attention = generated
        outs.append([r.output for r in Engine(model, num_blocks=64).generate(prompts, SamplingParams(max_new_tokens=8))])
    agree = sum(a == b for x, y in zip(*outs) for a, b in zip(x, y))
    assert agree >= 0.9 * 3 * 8, outs  # bf16: rare near-ties may differ


def test_decoder_cuda_graphs_match_eager():
    """Decode steps replayed from CUDA graphs against the eager forward on the same inputs (bf16), at every
    step of a ragged run whose requests join (one with a 1-token prompt, in a decode step) and leave, through
    padded buckets: the logits agree within bf16 rounding. (Comparing sampled tokens instead lets one near-tie,
    e.g. from a GEMM schedule chosen for 4 rows instead of 3, change every later token.) Then a whole bucket
    of 4, with no padding rows, token for token."""
    from flashgen.runtime.decoder.bench import CONFIGS, random_weights
    from flashgen.runtime.decoder.engine import Engine
    from flashgen.runtime.decoder.sampling import SamplingParams
    from flashgen.runtime.decoder.model import Batch, Decoder
    c = CONFIGS["tiny"]
    model = Decoder(c, random_weights(c, torch.bfloat16, DEVICE), DEVICE, torch.bfloat16)
    joins = {0: [([1, 2, 3, 4, 5] * 7, 12), ([9] * 3, 5), (list(range(100)), 9)],
             3: [([7] * 20, 6), ([8] * 10, 8)], 5: [([42], 10)], 9: [(list(range(50, 90)), 4)]}
    eng = Engine(model, num_blocks=64, cuda_graphs=True)
    replay, errors = eng.graphs.run, []

    def checked(seqs, tokens, positions, slots):
        """The eager forward first (it writes the same keys and values to the same slots), then the replay
        (a chained step's tokens are those the previous replay chose, on the device)."""
        dev = model.device
        tokens = eng.graphs.chosen(len(seqs)).tolist() if tokens is None else tokens
        batch = Batch(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                      torch.tensor(slots, device=dev), seqs, [1] * len(seqs), [p + 1 for p in positions])
        ref = model.forward(batch, eng.cache).float()
        out = replay(seqs, tokens, positions, slots)
        errors.append(((out.float() - ref).abs().max() / ref.abs().max()).item())
        return out

    eng.graphs.run = checked
    ids, step = [], 0
    while step in joins or step < max(joins) or eng.waiting or eng.running:
        ids += [eng.add(p, SamplingParams(max_new_tokens=n)) for p, n in joins.get(step, [])]
        eng.step()
        step += 1
    # decode steps of 3, 5, 4, 3, 2, 1 sequences: buckets 4 and 8 with padding rows, 2 and 1 without
    assert set(eng.graphs.graphs) == {1, 2, 4, 8} and len(errors) >= 10
    assert [len(eng.finished[i].output) for i in ids] == [12, 5, 9, 6, 8, 10, 4]
    assert max(errors) < 2e-2, errors

    prompts = [[5, 6, 7] * 9, [11] * 40, [3], list(range(60))]
    whole = [[r.output for r in Engine(model, num_blocks=64, cuda_graphs=g).generate(
        prompts, SamplingParams(max_new_tokens=16))] for g in (False, True)]
    assert whole[0] == whole[1]
    # stop tokens met inside chained steps: the extra token computed after each is not kept
    stops = (whole[0][1][4], whole[0][3][9])
    stopped = [[r.output for r in Engine(model, num_blocks=64, cuda_graphs=g).generate(
        prompts, SamplingParams(max_new_tokens=16, stop_tokens=stops))] for g in (False, True)]
    assert stopped[0] == stopped[1]
    assert [o[:len(s)] for o, s in zip(whole[0], stopped[0])] == stopped[0] and len(stopped[0][1]) <= 5
    # a repetition penalty: the penalized argmax, read from the replay's logits rather than the graph's pick
    penalized = [[r.output for r in Engine(model, num_blocks=64, cuda_graphs=g).generate(
        prompts, SamplingParams(max_new_tokens=16, repetition_penalty=2.0))] for g in (False, True)]
    assert penalized[0] == penalized[1] and penalized[0] != whole[0]


def test_engines_with_and_without_graphs_compute_the_same_logits():
    """Every step's logits of an engine replaying CUDA graphs equal, bit for bit, those of an engine
    without (bf16; a whole bucket of 4, so no padding rows; a repetition penalty, so that every step's
    logits reach the host and the tokens are the penalized argmax). Both engines keep the pad block
    beside their num_blocks, so their cache size and table width, hence every step's workloads and
    kernels, are the same: with the pad block taken out of num_blocks, the graphs' tables were a block
    narrower and its paged-decode attention another workload, whose rounding turned a near-tie of the
    penalized logits into other tokens from the 6th on."""
    from flashgen.runtime.decoder.bench import CONFIGS, random_weights
    from flashgen.runtime.decoder.engine import Engine
    from flashgen.runtime.decoder.sampling import SamplingParams
    from flashgen.runtime.decoder.model import Decoder
    c = CONFIGS["tiny"]
    model = Decoder(c, random_weights(c, torch.bfloat16, DEVICE), DEVICE, torch.bfloat16)
    prompts = [[5, 6, 7] * 9, [11] * 40, [3], list(range(60))]
    runs = []
    for graphs in (False, True):
        eng, steps = Engine(model, num_blocks=64, cuda_graphs=graphs), []
        record = eng._record

        def kept(reqs, chosen, logits, record=record, steps=steps):
            steps.append(logits.float().cpu())
            return record(reqs, chosen, logits)

        eng._record = kept
        params = SamplingParams(max_new_tokens=16, repetition_penalty=2.0, stop_tokens=())
        out = [r.output for r in eng.generate(prompts, params)]
        assert (eng.graphs is not None and set(eng.graphs.graphs) == {4}) == graphs
        runs.append((steps, out))
    (eager, eager_out), (graphed, graphed_out) = runs
    assert len(eager) == len(graphed) == 16  # the prefill step, then 15 decode steps
    differ = [(i, (a - b).abs().max().item()) for i, (a, b) in enumerate(zip(eager, graphed)) if not torch.equal(a, b)]
    assert not differ, differ
    assert eager_out == graphed_out


def test_graphs_follow_the_context_bucket_and_match_eager():
    """Greedy decoding whose contexts cross 512 tokens (tiny's window: 1024): the engine with graphs
    captures the bucket's step at attention contexts 512 and 1024 (`Decoder.attention_context`) and
    chains its replays across the new capture (which keeps the tokens the last replay left in the shared
    inputs); the tokens equal an engine's without graphs, whose eager steps dispatch at the same L."""
    from flashgen.runtime.decoder.bench import CONFIGS, random_weights
    from flashgen.runtime.decoder.engine import Engine
    from flashgen.runtime.decoder.sampling import SamplingParams
    from flashgen.runtime.decoder.model import Decoder
    c = CONFIGS["tiny"]
    model = Decoder(c, random_weights(c, torch.bfloat16, DEVICE), DEVICE, torch.bfloat16)
    prompts = [[3 + i % 250 for i in range(500)], [7, 8] * 240]  # 500 and 480 tokens, 30 more each: contexts up to 530
    outs, engines = [], []
    for graphs in (False, True):
        eng = Engine(model, num_blocks=80, cuda_graphs=graphs)
        outs.append([r.output for r in eng.generate(prompts, SamplingParams(max_new_tokens=30, stop_tokens=()))])
        engines.append(eng)
    assert sorted(engines[1].graphs.graphs[2].replays) == [512, 1024]
    assert outs[0] == outs[1] and all(len(o) == 30 for o in outs[0])


def test_engines_of_any_cache_size_share_one_process():
    """Engines whose block tables are 64 and then 63 blocks wide in one process: the generated attention
    binary built for the first serves the second (a table width is a row dim, never promised divisible
    by 16 in the binary); before, every request of the second engine failed its first step."""
    from flashgen.runtime.decoder.bench import CONFIGS, random_weights
    from flashgen.runtime.decoder.engine import Engine
    from flashgen.runtime.decoder.sampling import SamplingParams
    from flashgen.runtime.decoder.model import Decoder
    c = CONFIGS["tiny"]
    model = Decoder(c, random_weights(c, torch.bfloat16, DEVICE), DEVICE, torch.bfloat16)
    for blocks in (64, 63):
        eng = Engine(model, num_blocks=blocks)
        done = eng.generate([[5, 6, 7] * 9, [3], list(range(60))], SamplingParams(max_new_tokens=8, stop_tokens=()))
        assert model.table_width(eng.cache) == blocks
        assert [(r.error, len(r.output)) for r in done] == [("", 8)] * 3


def test_bench_runs_give_their_memory_back():
    """Quant modes and batches run one after another in one process, as benchmarks/model.py runs them:
    what a decode returns holds nothing of its engine (its KV cache and graphs are gone before the next
    batch allocates its own), and after a mode's run its weights, caches and graph pools are given back
    to the device (torch's allocator keeps no more than partly used segments), so the next mode finds
    them free. SmolLM2-135M's shape: its 0.27 GB of bf16 weights would stay reserved otherwise."""
    from flashgen.runtime.decoder import bench
    from flashgen.runtime.decoder.model import Decoder
    config, slack = "smollm2-135m", 64 << 20
    c = bench.CONFIGS[config]
    model = Decoder(c, bench.random_weights(c, torch.bfloat16, DEVICE), DEVICE, torch.bfloat16)
    bench.decode(model, 4, 20, 6)  # (builds the rope table the model keeps, and loads the kernels)
    bench.release(DEVICE)
    held = torch.cuda.memory_allocated(DEVICE)
    r = bench.decode(model, 4, 20, 6)
    assert r["cuda_graphs"] and r["graph_rows"] == 4
    assert torch.cuda.memory_allocated(DEVICE) - held < 1 << 20  # its KV cache alone is 9.6 MB
    del model
    base = None
    for quant in ("bf16", "w4a16", "bf16"):
        rows = bench.run(config, [1, 4], 20, 6, quant, 1000.0, device="cuda")
        assert [r["batch"] for r in rows] == [1, 4] and all(r["free_gb_before"] > 0 for r in rows)
        allocated = torch.cuda.memory_allocated(DEVICE)
        base = allocated if base is None else base
        assert allocated - base < slack and torch.cuda.memory_reserved(DEVICE) - allocated < slack, quant


def test_nan_logits_in_replayed_steps_fail_their_requests():
    """Logits that turn NaN inside chained steps replayed from CUDA graphs (the lm_head poisoned in place,
    as an overflow would) fail every request naming the step, instead of decoding token 0 on; the
    chained inputs stay valid ids (no device-side assert), and the blocks are freed."""
    from flashgen.runtime.decoder.bench import CONFIGS, random_weights
    from flashgen.runtime.decoder.engine import Engine
    from flashgen.runtime.decoder.sampling import SamplingParams
    from flashgen.runtime.decoder.model import Decoder
    c = CONFIGS["tiny"]
    model = Decoder(c, random_weights(c, torch.bfloat16, DEVICE), DEVICE, torch.bfloat16)
    eng = Engine(model, num_blocks=64, cuda_graphs=True)
    ids = [eng.add(p, SamplingParams(max_new_tokens=12)) for p in ([1, 2, 3] * 5, [9] * 7)]
    for _ in range(4):
        eng.step()
    assert eng.graphs.graphs and all(len(r.output) >= 2 for r in eng.running)
    model.lm_head[5] = float("nan")  # every row's logit of token 5, from the next replay on
    while eng.running or eng.waiting:
        eng.step()
    for i in ids:
        r = eng.finished[i]
        assert r.error.startswith("the logits at step ") and r.error.endswith(" are NaN or inf"), r.error
        assert 2 <= len(r.output) < 12
    m = eng.cache.manager  # every block but the graphs' pad block is free again, or idle in the prefix cache
    assert sorted(m.free + list(m.cached)) + [m.pad] == list(range(len(eng.cache.k[0]))) and not m.tables


def test_prefix_cache_keeps_the_tokens_on_gpu():
    """Requests sharing a 37-token system prompt through engines with and without the prefix cache, decode
    steps replayed from CUDA graphs and chained (bf16, the generated attention: the cached part is read by
    the chunked-prefill kernel; a prompt with one token past its cached blocks runs as a graph replay):
    each request takes the blocks it should, every block ends free or idle, and the tokens are the same,
    except from a token where the reference's own logits hold a near-tie that bf16 rounding of a prompt
    computed in two parts may turn (the other token then being the runner-up)."""
    from flashgen.runtime.decoder.bench import CONFIGS, random_weights
    from flashgen.runtime.decoder.engine import Engine
    from flashgen.runtime.decoder.model import Decoder
    from flashgen.runtime.decoder.sampling import SamplingParams
    from flashgen.runtime.decoder.scoring import prompt_logits
    c = CONFIGS["tiny"]
    model = Decoder(c, random_weights(c, torch.bfloat16, DEVICE), DEVICE, torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    system = torch.randint(0, c.vocab_size, (37,), generator=g).tolist()
    prompts = [system + torch.randint(0, c.vocab_size, (n,), generator=g).tolist() for n in (4, 11, 0, 20)]
    params = SamplingParams(max_new_tokens=16, stop_tokens=())
    runs = {}
    for on in (False, True):
        eng = Engine(model, num_blocks=64, cuda_graphs=True, prefix_cache=on)
        reqs = eng.generate(prompts[:1], params) + eng.generate(prompts, params) + eng.generate([system[:33]], params)
        assert eng.graphs is not None and eng.graphs.graphs and model.uses_tables
        m = eng.cache.manager
        assert not m.tables and not m.refs and sorted(m.free + list(m.cached)) == list(range(64))
        runs[on] = [(r.prompt, r.output, r.cached_tokens, r.error) for r in reqs]
    assert [x[2] for x in runs[True]] == [0] + [32] * 5 and {x[2] for x in runs[False]} == {0}
    assert all(x[3] == "" and len(x[1]) == 16 for x in runs[False] + runs[True])
    for (prompt, want, _, _), (_, got, _, _) in zip(runs[False], runs[True]):
        j = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if j is not None:
            logits = prompt_logits(model, prompt + want[:j])[-1].float()
            top = logits.topk(2)
            assert top.values[0] - top.values[1] <= 0.05 * logits.abs().max() and got[j] in top.indices.tolist(), \
                (j, want, got)


@pytest.mark.parametrize("mode", ["w8a16", "w4a16", "w8a8", "w4a8", "fp8", "mixed"])
def test_quantized_linear_on_gpu(mode):
    """A layer quantized on the GPU (no dequantized copy kept there) against the same weight quantized
    on the CPU and multiplied by torch: the same codes and scales, products within the dtype's error."""
    import dataclasses

    from flashgen.runtime import register_all
    from flashgen.runtime.decoder.linear import apply
    from flashgen.runtime.decoder.quant_modes import MixedLinear, prepare
    register_all()  # apply() calls torch.ops.flashgen.*
    gen = torch.Generator().manual_seed(23)
    w = (torch.randn(384, 512, generator=gen) * 0.05).to(torch.bfloat16)
    x = torch.randn(5, 512, generator=gen).to(torch.bfloat16)
    dev, cpu = prepare(w.to(DEVICE), mode), prepare(w, mode)
    assert type(dev) is type(cpu) and dev.weight is None and dev.shape == (384, 512)
    pairs = list(zip(dev.choices.values(), cpu.choices.values())) if isinstance(dev, MixedLinear) else [(dev, cpu)]
    for d, c in pairs:
        assert d.weight is None
        for f in dataclasses.fields(d):
            a, b = getattr(d, f.name), getattr(c, f.name)
            if f.name in ("weight", "w4a8_int8") or not isinstance(a, torch.Tensor):  # (the CPU's own copies)
                continue
            bits = (lambda t: t.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else (lambda t: t)  # (torch.equal has no fp8)
            assert torch.equal(bits(a.cpu()), bits(b)), f.name
    # w4a8 on the CPU keeps its int8 operand; mixed the 4-bit weight's dequantized copy: mixed runs w4a8
    pick = lambda n, k, m: "w4a8"  # noqa: E731
    out = apply(x.to(DEVICE), dev, None, set(), chooser=pick).float().cpu()
    chosen = cpu.choose(5, pick)
    if chosen.weight is not None:
        weight = chosen.weight.float()
    else:
        w8, scale = chosen.int8_operand()
        weight = w8.float() * scale[:, None]
    ref = torch.nn.functional.linear(x.float(), weight)
    assert torch.allclose(out, ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item()), (out - ref).abs().max()


NORM_CASES = [(flashgen.workload(op, M=m, N=330, K=1152, dtype="bf16", **kw), s) for op, kw, m, s in (
    ("rmsnorm_gemm", {}, 1, {"block_m": 1, "block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 3, "early_load": 1}),
    ("rmsnorm_gemm", {"with_residual": "yes"}, 3, {"block_m": 2, "block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 1}),
    ("rmsnorm_gemm", {}, 17, {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3, "split_k": 2}),
    ("rmsnorm_gemm_w4a16", {"G": 128}, 1, {"block_m": 1, "block_n": 16, "block_k": 1024, "num_warps": 4, "num_stages": 1,
                                          "ptx_unpack": 2, "early_load": 1}),
    ("rmsnorm_gemm_w4a16", {"G": 128, "zp": "asym"}, 3, {"block_m": 4, "block_n": 16, "block_k": 512, "num_warps": 2,
                                                        "num_stages": 3, "ptx_unpack": 1}),
    ("rmsnorm_gemm_w4a16", {"G": 128}, 16, {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3,
                                           "ptx_unpack": 1}),
    ("rmsnorm_gemm_w8a16", {"with_bias": "yes"}, 5, {"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4,
                                                    "num_stages": 3}),
    ("rmsnorm_gemm", {}, 2, {"block_m": 2, "block_n": 16, "block_k": 256, "num_warps": 2, "num_stages": 3, "split_k": 2}))] + [
    (flashgen.workload("rmsnorm_gemm_w4a16", M=1, N=330, K=1152, G=128, dtype="fp16"),
     {"block_m": 1, "block_n": 16, "block_k": 512, "num_warps": 2, "num_stages": 3, "ptx_unpack": 2})] + [
    (flashgen.workload(op, M=m, N=330, K=1152, dtype="bf16", **kw), s) for op, kw, m, s in (
        ("silu_mul_gemm", {"with_residual": "yes"}, 1, {"block_m": 1, "block_n": 16, "block_k": 512, "num_warps": 4,
                                                         "num_stages": 3, "early_load": 1}),
        ("silu_mul_gemm", {}, 17, {"block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4, "num_stages": 3}),
        ("silu_mul_gemm_w4a16", {"G": 128}, 1, {"block_m": 1, "block_n": 16, "block_k": 1024, "num_warps": 4,
                                               "num_stages": 1, "ptx_unpack": 2, "early_load": 1}))]


@pytest.mark.parametrize("wl, s", NORM_CASES, ids=lambda v: case_id(v) if hasattr(v, "op") else str(len(v)))
def test_fused_prologue_gemm_on_gpu(wl, s):
    """A GEMM with the SiLU·mul of its input fused (an elementwise prologue), or its RMSNorm: unsplit GEMV tiles of 1-4 rows sum the squares in
    their k loop and scale each row's sum after it (fp32, fp16 pairs and quads of int4 codes, bf16
    and fp16 x, early weight loads, one stage); matrix tiles, the transposed int4 tile and split
    GEMV tiles run a row pass before the k loop. K=1152 and N=330 leave partial k and column tiles."""
    s = {"group_m": 1, **s}
    assert ScheduleSpace(wl, TARGET).is_valid(s), ScheduleSpace(wl, TARGET).why_invalid(s)
    kernel = flashgen.compile(wl, TARGET, schedule=s)
    for c in check(wl, _run(kernel), 31, DEVICE):
        assert c.ok, (c, s)


@pytest.mark.parametrize("mode", ["bf16", "w4a16", "w8a16"])
def test_decoder_fused_prologues_match_separate_kernels(mode, monkeypatch):
    """A decode step of 3 sequences with each norm and SiLU·mul fused into the linear it feeds (the
    row limit of runtime/decoder/linear.py widened to it, the mode's class made to fuse) against the same model with their own
    kernels: logits within bf16 rounding."""
    import flashgen.runtime.decoder.linear as linear
    from flashgen.runtime.decoder.bench import CONFIGS, random_weights
    from flashgen.runtime.decoder.quant_modes import quant_mode
    from flashgen.runtime.decoder.engine import Engine
    from flashgen.runtime.decoder.model import Batch, Decoder
    c = CONFIGS["tiny"]
    model = Decoder(c, random_weights(c, torch.bfloat16, DEVICE), DEVICE, torch.bfloat16, quant=mode)
    eng = Engine(model, num_blocks=64)
    m, seqs, positions = eng.cache.manager, [0, 1, 2], [39, 11, 25]
    slots = [m.reserve(i, p + 1)[p // m.block_size] * m.block_size + p % m.block_size for i, p in zip(seqs, positions)]
    batch = Batch(torch.tensor([5, 7, 9], device=DEVICE), torch.tensor(positions, device=DEVICE),
                  torch.tensor(slots, device=DEVICE), seqs, [1, 1, 1], [p + 1 for p in positions])
    monkeypatch.setattr(quant_mode(mode), "fused", True)
    monkeypatch.setattr(linear, "FUSED_MAX_ROWS", 16)
    fused = model.forward(batch, eng.cache).float()
    ops = {d.workload.op_name for d in dispatcher().decisions.values()}
    assert {"rmsnorm_" + linear_op(mode), "silu_mul_" + linear_op(mode)} <= ops, ops
    monkeypatch.setattr(linear, "FUSED_MAX_ROWS", 0)
    separate = model.forward(batch, eng.cache).float()
    err = ((fused - separate).abs().max() / separate.abs().max()).item()
    assert err < 2e-2, err


def linear_op(mode: str) -> str:
    return {"bf16": "gemm", "w4a16": "gemm_w4a16", "w8a16": "gemm_w8a16"}[mode]


def test_tune_behind_a_producer_on_gpu(tmp_path):
    """Candidates timed right behind the kernel that writes their input, in CUDA graphs: each is checked
    first, then recorded with its cost there, timed behind, and dispatch serves the fastest of those."""
    from flashgen.db import Database
    from flashgen.runtime.serving.dispatch import Dispatcher
    from flashgen.schedules.tuner import TuneTask, tune

    wl = flashgen.workload("gemm", M=1, N=4096, K=4096, dtype="bf16")
    producer = flashgen.workload("rmsnorm", M=1, N=4096, dtype="bf16")
    with Database(tmp_path / "t.db") as db:
        behind = (producer, ScheduleSpace(producer, TARGET).default())
        res = tune(TuneTask(wl, TARGET, 3, strategy="random", behind=behind), db, progress=None)
        recs = db.records(wl.key, TARGET.id)
    assert res.measured == 3 and [r.status for r in recs] == ["ok"] * 3, [r.extra for r in recs]
    assert all(r.timing == "behind" and 1.0 < r.latency_us < 1000.0 for r in recs), [r.latency_us for r in recs]
    d = Dispatcher(TARGET, tmp_path / "t.db").choose(wl, TARGET)
    assert d.schedule == res.best.schedule and d.source == "exact (timed behind rmsnorm)"


@pytest.mark.parametrize("rows", [2, 8, 16])
def test_w4a16_rows_never_run_a_one_row_gemv_tile_on_gpu(rows, monkeypatch):
    """Llama-3-8B's W4A16 qkv linear at 2-16 rows, served by the shipped records: dispatch runs a tile
    of at least the call's rows (the M=1 records' one-row GEMV tiles would read the weight once per
    row), and the product matches torch's on the same dequantized weight."""
    from flashgen.runtime import register_all
    from flashgen.runtime.decoder.linear import apply
    from flashgen.runtime.decoder.quant_modes import prepare
    from flashgen.schedules.contraction_space import flat_of
    monkeypatch.setenv("FLASHGEN_SHIPPED", "1")
    register_all()
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(6144, 4096, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(rows, 4096, generator=gen).to(torch.bfloat16)
    q = prepare(w.to(DEVICE), "w4a16")
    out = apply(x.to(DEVICE), q, None, set()).float().cpu()
    ref = torch.nn.functional.linear(x.float(), prepare(w, "w4a16").weight.float())
    assert torch.allclose(out, ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item()), (out - ref).abs().max()
    d = next(d for d in dispatcher().decisions.values()
             if d.workload.op_name == "gemm_w4a16" and d.workload.dim["M"] == rows and d.workload.dim["N"] == 6144)
    s = ScheduleSpace(d.workload, TARGET).complete(d.schedule)
    assert flat_of(d.workload, s)["block_m"] >= rows, d.source
    assert "bucket M=1," not in d.source.split(" (")[0], d.source


def test_kept_buffers_stay_out_of_a_cudagraph_tree_pool():
    """A launcher's kept buffer made while the thread's allocations go to a CUDA-graph pool (as
    torch.compile's CUDA-graph trees route them on a graph's first calls) lies outside that pool, zeroed;
    an ordinary allocation at the same moment lies inside it."""
    from flashgen.targets.buffers import kept_buffer

    pool = torch.cuda.graph_pool_handle()
    dev = torch.cuda.current_device()
    torch._C._cuda_beginAllocateCurrentThreadToPool(dev, pool)
    try:
        kept = kept_buffer(3 << 20, torch.int32, DEVICE, zeroed=True)
        ordinary = torch.empty(3 << 20, dtype=torch.int32, device=DEVICE)
    finally:
        torch._C._cuda_endAllocateToPool(dev, pool)
    pools = {}
    for seg in torch.cuda.memory_snapshot():
        for t in (kept, ordinary):
            if seg["address"] <= t.data_ptr() < seg["address"] + seg["total_size"]:
                pools[t.data_ptr()] = tuple(seg["segment_pool_id"])
    assert pools[ordinary.data_ptr()] == tuple(pool)
    assert pools[kept.data_ptr()] != tuple(pool)
    assert int(kept.abs().max()) == 0
    del ordinary
    torch._C._cuda_releasePool(dev, pool)
