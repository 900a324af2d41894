"""Runtime: torch custom ops on CPU tensors, torch.compile through their fake implementations,
dispatch by shape (exact record, nearest tuned bucket, default) and warm starts that compile nothing."""
from __future__ import annotations

import math

import pytest
import torch

import flashgen
from flashgen.cli import main
from flashgen.db import Database, Record
from flashgen.runtime import Dispatcher, register_all
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target


register_all()


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_custom_ops_on_cpu_tensors():
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(7, 257, generator=g), torch.randn(7, 257, generator=g), torch.randn(257, generator=g)
    wl = flashgen.workload("add_rmsnorm", M=7, N=257, dtype="fp32")
    ref = wl.op.reference({"x": x, "residual": r, "w": w}, {"eps": 1e-5}, wl.dim, wl.attr)
    y, h = torch.ops.flashgen.add_rmsnorm(x, r, w, 1e-5)
    assert rel(y, ref["y"]) < 1e-5 and rel(h, ref["residual_out"]) < 1e-6
    q, k = torch.randn(3, 4, 64, generator=g), torch.randn(3, 2, 64, generator=g)
    pos = torch.tensor([0, 5, 9])
    from flashgen.oplib.rope import cos_sin_cache
    cs = cos_sin_cache(16, 64)
    qo, ko = torch.ops.flashgen.rope(q, k, pos, cs, style="gptj")
    rwl = flashgen.workload("rope", M=3, Hq=4, Hkv=2, D=64, L=16, dtype="fp32", style="gptj")
    ref = rwl.op.reference({"q": q, "k": k, "positions": pos, "cos_sin": cs}, {}, rwl.dim, rwl.attr)
    assert rel(qo, ref["q_out"]) < 1e-5 and rel(ko, ref["k_out"]) < 1e-5
    # rope_cache: the same rotation, and k and v stored at their slots of the caches passed in (in place)
    v = torch.randn(3, 2, 64, generator=g)
    kc, vc = torch.randn(10, 2, 64, generator=g), torch.randn(10, 2, 64, generator=g)
    before = kc.clone()
    slots = torch.tensor([7, 0, 4])
    qo2, ko2 = torch.ops.flashgen.rope_cache(q, k, pos, cs, v, slots, kc, vc, style="gptj")
    assert rel(qo2, ref["q_out"]) < 1e-5 and rel(ko2, ref["k_out"]) < 1e-5
    assert torch.equal(kc[slots], ko2) and torch.equal(vc[slots], v)
    rest = torch.ones(10, dtype=torch.bool).index_fill_(0, slots, False)
    assert torch.equal(kc[rest], before[rest])
    from flashgen.oplib import get_op
    from flashgen.runtime.serving.torch_ops import schema
    assert "Tensor(a!) k_cache, Tensor(b!) v_cache" in schema(get_op("rope_cache"))


def test_torch_compile_sees_through_fake_impls():
    x, w = torch.randn(4, 96), torch.randn(96)

    def block(x, w):
        y = torch.ops.flashgen.rmsnorm(x * 2, w)
        q, s = torch.ops.flashgen.dynamic_quant(y, out_dtype="int8")
        return q.float() * s[:, None]

    eager = block(x, w)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x, w)
    assert torch.equal(eager, compiled) and eager.dtype == torch.float32


def _record(db, wl, schedule, lat):
    db.add(Record(workload_key=wl.key, workload=wl.to_json(), target_key="cuda:sm_90/h200", schedule=schedule,
                  status="ok", latency_us=lat, device="NVIDIA H200"))


def test_dispatch_exact_bucket_default(tmp_path, capsys):
    h200 = get_target("h200")
    db_path = tmp_path / "t.db"
    s64 = {"block_r": 4, "block_c": 1024, "num_warps": 4}
    s4096 = {"block_r": 1, "block_c": 1024, "num_warps": 8}
    with Database(db_path) as db:
        _record(db, flashgen.workload("rmsnorm", M=64, N=1000, dtype="bf16"), s64, 3.0)
        _record(db, flashgen.workload("rmsnorm", M=4096, N=1000, dtype="bf16"), s4096, 20.0)
    d = Dispatcher(h200, db_path)
    choose = lambda m: d.choose(flashgen.workload("rmsnorm", M=m, N=1000, dtype="bf16"), h200)  # noqa: E731
    assert (choose(64).source, choose(64).schedule) == ("exact", s64)
    assert (choose(40).source, choose(40).schedule) == ("bucket M=64", s64)          # M rounded up
    assert (choose(1000).source, choose(1000).schedule) == ("bucket M=4096", s4096)
    assert (choose(9000).source, choose(9000).schedule) == ("bucket M=4096", s4096)  # above every bucket
    other = d.choose(flashgen.workload("rmsnorm", M=64, N=1024, dtype="bf16"), h200)
    assert other.source == "default"
    fp16 = d.choose(flashgen.workload("rmsnorm", M=40, N=1000, dtype="fp16"), h200)  # tuned only in bf16
    assert (fp16.source, fp16.schedule) == ("bucket M=64, tuned in bf16", s64)
    assert d.choose(flashgen.workload("rmsnorm", M=40, N=1000, dtype="fp32"), h200).source == "default"
    w = torch.randn(1000, dtype=torch.bfloat16)
    for m in (40, 64):
        d.kernel("rmsnorm", {"x": torch.randn(m, 1000, dtype=torch.bfloat16), "w": w})
    d.kernel("rmsnorm", {"x": torch.randn(40, 1000, dtype=torch.float16), "w": w.half()})
    assert d.sources("rowwise") == {"bucket": 1, "exact": 1, "other-dtype bucket": 1}
    assert d.sources("rowwise", rows=64) == {"exact": 1} and d.sources("contraction") == {}
    from flashgen.runtime.serving.dispatch import describe_sources
    assert describe_sources(d.sources("rowwise")) == "bucket 1, exact 1, other-dtype bucket 1"
    assert main(["explain", "rmsnorm", "--dim", "M=40", "--dim", "N=1000", "--target", "h200", "--db", str(db_path)]) == 0
    assert "bucket M=64" in capsys.readouterr().out


def test_dispatch_takes_another_device_of_the_architecture(tmp_path):
    """An H100 with no records of its own runs the schedules tuned on the H200 (same sm_90 binaries),
    said so in the decision; a record of the very workload comes first, the H100's own or the H200's,
    then the H100's own buckets before the H200's."""
    h100 = get_target("h100")
    db_path = tmp_path / "t.db"
    s64 = {"block_r": 4, "block_c": 1024, "num_warps": 4}
    wl = flashgen.workload("rmsnorm", M=64, N=1000, dtype="bf16")
    with Database(db_path) as db:
        _record(db, wl, s64, 3.0)
    d = Dispatcher(h100, db_path)
    for m, source in ((64, "exact, tuned on cuda:sm_90/h200"), (40, "bucket M=64, tuned on cuda:sm_90/h200")):
        got = d.choose(flashgen.workload("rmsnorm", M=m, N=1000, dtype="bf16"), h100)
        assert (got.source, got.kind, got.schedule, got.target) == (source, "other-device record", s64, h100.id)
    assert d.choose(flashgen.workload("rmsnorm", M=64, N=1024, dtype="bf16"), h100).source == "default"
    own = {"block_r": 2, "block_c": 512, "num_warps": 8}
    with Database(db_path) as db:
        db.add(Record(workload_key=flashgen.workload("rmsnorm", M=32, N=1000, dtype="bf16").key,
                      workload=flashgen.workload("rmsnorm", M=32, N=1000, dtype="bf16").to_json(),
                      target_key=h100.id, schedule=own, status="ok", latency_us=2.0, device="NVIDIA H100 80GB HBM3"))
    d = Dispatcher(h100, db_path)
    assert (d.choose(wl, h100).source, d.choose(wl, h100).schedule) == ("exact, tuned on cuda:sm_90/h200", s64)
    m48 = flashgen.workload("rmsnorm", M=48, N=1000, dtype="bf16")
    assert (d.choose(m48, h100).source, d.choose(m48, h100).schedule) == ("bucket M=32", own)  # its own bucket first
    assert d.choose(wl, get_target("h200")).source == "exact"  # the H200 keeps its own


def test_dispatch_falls_back_to_the_plain_form(tmp_path):
    """A fused variant (a norm or gate in the prologue, a residual in the epilogue) without records of
    its own runs the schedule tuned for its plain form, which streams the same weights; its own
    records win once it has them, and a plain-form schedule outside its space is not taken."""
    h200 = get_target("h200")
    db_path = tmp_path / "t.db"
    gemv = {"block_m": 1, "block_n": 16, "block_k": 1024, "num_warps": 4, "num_stages": 4, "group_m": 1,
            "early_load": 1}
    with Database(db_path) as db:
        _record(db, flashgen.workload("gemm", M=1, N=4096, K=4096, dtype="bf16"), gemv, 13.0)
        _record(db, flashgen.workload("gemm", M=64, N=4096, K=4096, dtype="bf16"),
                {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3, "group_m": 8, "tma": 1}, 20.0)
    d = Dispatcher(h200, db_path)
    normed = d.choose(flashgen.workload("rmsnorm_gemm", M=1, N=4096, K=4096, dtype="bf16"), h200)
    assert (normed.source, normed.kind) == ("bucket M=1, tuned as gemm", "plain-form bucket")
    assert {k: v for k, v in normed.schedule.items() if k in gemv} == gemv
    gated = d.choose(flashgen.workload("silu_mul_gemm", M=1, N=4096, K=4096, dtype="bf16", with_residual="yes"), h200)
    assert gated.source == "bucket M=1, tuned as gemm with_residual=no"
    residual = d.choose(flashgen.workload("gemm", M=1, N=4096, K=4096, dtype="bf16", with_residual="yes"), h200)
    assert residual.source == "bucket M=1, tuned as gemm with_residual=no"
    # a TMA schedule needs plain operand loads: the normed GEMM at M=64 cannot take it (nor the
    # one-row tile, outside the space at 64 rows)
    assert d.choose(flashgen.workload("rmsnorm_gemm", M=64, N=4096, K=4096, dtype="bf16"), h200).source == "default"
    with Database(db_path) as db:
        _record(db, flashgen.workload("rmsnorm_gemm", M=1, N=4096, K=4096, dtype="bf16"), {**gemv, "num_stages": 3}, 12.0)
    assert Dispatcher(h200, db_path).choose(normed.workload, h200).source == "exact"


def test_call_rows_in_another_form_before_another_row_count(tmp_path):
    """A record at the call's rows, though of the plain form and tuned on a sibling device, serves before
    the device's own record of the call's form at another row count; where no form has the call's
    rows, the own bucket serves as before."""
    h100 = get_target("h100")
    db_path = tmp_path / "t.db"
    plain256 = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 5, "group_m": 8,
                "split_k": 2, "tma": 1}
    own64 = {"block_m": 32, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 5, "group_m": 8,
             "split_k": 2, "tma": 1}
    residual = lambda m: flashgen.workload("gemm", M=m, N=4096, K=14336, dtype="bf16", with_residual="yes")  # noqa: E731
    with Database(db_path) as db:
        _record(db, flashgen.workload("gemm", M=256, N=4096, K=14336, dtype="bf16"), plain256, 51.6)
        db.add(Record(workload_key=residual(64).key, workload=residual(64).to_json(), target_key=h100.id,
                      schedule=own64, status="ok", latency_us=48.0, device="NVIDIA H100 80GB HBM3"))
    d = Dispatcher(h100, db_path)
    got = d.choose(residual(256), h100)
    assert got.source == "bucket M=256, tuned as gemm with_residual=no, tuned on cuda:sm_90/h200", got.source
    assert {k: v for k, v in got.schedule.items() if k in ("block_m", "split_k")} == {"block_m": 128, "split_k": 2}
    got = d.choose(residual(128), h100)
    assert got.source == "bucket M=64" and got.schedule["block_m"] == 32, got.source


def test_bucket_never_crosses_a_kernel_regime(tmp_path):
    """A GEMV tile serves a call only where it covers the call's rows (each further row tile reads the
    whole weight again): an fp16 record of the call's M wins over a bf16 one-row GEMV record, which a
    bf16 call of 2-16 rows never takes (its decision says it was skipped and still classifies), while
    an 8-row GEMV tile serves up to 8 rows; a call of the record's own M takes it as measured."""
    h200 = get_target("h200")
    db_path = tmp_path / "t.db"
    w4 = lambda m, dtype="bf16": flashgen.workload("gemm_w4a16", M=m, N=4096, K=4096, G=128, dtype=dtype)  # noqa: E731
    # (the M=1 record in the flat form records were written in before variants, as the shipped ones)
    one = {"block_m": 1, "block_n": 16, "block_k": 2048, "num_warps": 4, "num_stages": 1, "group_m": 1, "split_k": 1,
           "persistent": 0, "ptx_unpack": 2, "tma": 0, "early_load": 0, "operand_scale": 0}
    eight = {"variant": "gemv_ptx_quad", "block_m": 8, "block_n": 16, "block_k": 1024, "num_warps": 8, "num_stages": 1,
             "group_m": 1, "split_k": 1, "persistent": 0}
    tile = {"variant": "tile_ptx", "block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3,
            "split_k": 4, "persistent": 0}
    assert all(ScheduleSpace(w4(16), h200).is_valid(s) for s in (one, eight, tile))  # valid: only the regime differs
    with Database(db_path) as db:
        _record(db, w4(1), one, 4.0)
    d = Dispatcher(h200, db_path)
    for m in (2, 5, 16):
        got = d.choose(w4(m), h200)
        assert (got.source, got.kind) == (f"default (bucket M=1 skipped: a GEMV tile of 1 row cannot serve {m} rows)",
                                          "default")
        assert got.schedule == ScheduleSpace(w4(m), h200).default()
    assert (d.choose(w4(1), h200).source, d.choose(w4(1), h200).schedule) == ("exact", one)
    with Database(db_path) as db:
        _record(db, w4(16, "fp16"), tile, 9.0)
        _record(db, w4(8), eight, 6.0)
    d = Dispatcher(h200, db_path)
    for m in (5, 8):  # the 8-row tile covers these rows (at 2 the space holds GEMV tiles of 1 and 2 rows only)
        assert (d.choose(w4(m), h200).source, d.choose(w4(m), h200).schedule) == ("bucket M=8" if m < 8 else "exact", eight)
    for m, skipped in ((2, 1), (9, 8)):
        got = d.choose(w4(m), h200)
        assert (got.schedule, got.kind) == (tile, "other-dtype bucket")
        assert got.source == (f"bucket M=16, tuned in fp16 (bucket M={skipped} skipped: a GEMV tile of {skipped} "
                              f"row{'s' * (skipped > 1)} cannot serve {m} rows)")
    # at 16 rows the fp16 record is of the call's own rows: it serves before any other row count is looked at
    got = d.choose(w4(16), h200)
    assert (got.schedule, got.kind, got.source) == (tile, "other-dtype bucket", "bucket M=16, tuned in fp16")


def test_dequant_first_schedules_serve_from_their_row_count(tmp_path):
    """A weight dequantized first (dq_*) serves DEQUANT_FIRST_MIN_M rows or more: its record at M=4096 is
    a bucket for 1024 rows, never for fewer than 512, whose space holds the fused tiles only."""
    from flashgen.schedules.contraction_space import DEQUANT_FIRST_MIN_M
    h200 = get_target("h200")
    w4 = lambda m: flashgen.workload("gemm_w4a16", M=m, N=4096, K=4096, G=128, dtype="fp16")  # noqa: E731
    staged = ScheduleSpace(w4(4096), h200).default()
    assert staged["variant"].startswith("dq_")
    for m in (DEQUANT_FIRST_MIN_M, 1024):
        assert ScheduleSpace(w4(m), h200).why_other_regime(staged) is None
    for m in (1, 16, 256, DEQUANT_FIRST_MIN_M - 1):
        assert ScheduleSpace(w4(m), h200).why_other_regime(staged) == \
            f"a weight dequantized first serves {DEQUANT_FIRST_MIN_M} rows or more, not {m}"
    db_path = tmp_path / "t.db"
    with Database(db_path) as db:
        _record(db, w4(4096), staged, 200.0)
    d = Dispatcher(h200, db_path)
    assert (d.choose(w4(1024), h200).source, d.choose(w4(1024), h200).schedule) == ("bucket M=4096", staged)
    for m in (16, 256, DEQUANT_FIRST_MIN_M - 1):
        got = d.choose(w4(m), h200)
        assert got.source == "default" and not got.schedule["variant"].startswith("dq_")


def test_a_tile_that_reads_the_weight_more_often_than_the_default_is_another_regime(tmp_path):
    """Where the default's row tile covers every row of a call and its programs fill the SMs, a matrix
    tile tuned at another row count serves it only if it covers every row too: a 16-row tile (the
    16-row record) at 64 rows reads the weight 4 times where the default's 64-row tile reads it once,
    and lost to it by 1.55-1.72x on the H100 (benchmarks/studies/bucket_vs_default.py); a 64-row tile
    tuned at 128 rows serves 64 rows, a 16-row tile serves 8, and 32 rows, with neither, get the
    default. Where the default's programs leave SMs idle, the bucket still serves."""
    h100 = get_target("h100")
    w4 = lambda m: flashgen.workload("gemm_w4a16", M=m, N=4096, K=4096, G=128, dtype="bf16")  # noqa: E731
    tile = lambda bm: {**ScheduleSpace(w4(bm), h100).default(), "split_k": 2}  # noqa: E731
    t16, t64 = tile(16), tile(64)
    assert ScheduleSpace(w4(16), h100).flat(t16)["block_m"] == 16 and ScheduleSpace(w4(64), h100).flat(t64)["block_m"] == 64
    assert ScheduleSpace(w4(64), h100).why_not_bucket(t16) == \
        "a tile of 16 rows reads the weight 4 times for 64 rows, the default's once"
    assert ScheduleSpace(w4(32), h100).why_not_bucket(t16) == \
        "a tile of 16 rows reads the weight 2 times for 32 rows, the default's once"
    assert ScheduleSpace(w4(64), h100).why_not_bucket(t64) is None
    assert ScheduleSpace(w4(8), h100).why_not_bucket(t16) is None
    # 128 rows: the default's 32 tiles of 128 x 128 leave most of 132 SMs idle, and such buckets won there
    assert ScheduleSpace(w4(128), h100).why_not_bucket(t16) is None
    db_path = tmp_path / "t.db"
    with Database(db_path) as db:
        for m, s in ((16, t16), (128, t64)):
            db.add(Record(workload_key=w4(m).key, workload=w4(m).to_json(), target_key=h100.id, schedule=s,
                          status="ok", latency_us=10.0 * m, device="NVIDIA H100 80GB HBM3"))
    d = Dispatcher(h100, db_path)
    got = {m: d.choose(w4(m), h100) for m in (8, 32, 64)}
    assert (got[8].source, got[8].schedule) == ("bucket M=16", t16)
    assert (got[32].source, got[32].schedule) == (  # (a 64-row tile is not in the 32-row space)
        "default (bucket M=16 skipped: a tile of 16 rows reads the weight 2 times for 32 rows, the default's once)",
        ScheduleSpace(w4(32), h100).default())
    assert (got[64].source, got[64].schedule) == ("bucket M=128", t64)
    d = Dispatcher(h100, tmp_path / "only16.db")
    with Database(tmp_path / "only16.db") as db:
        db.add(Record(workload_key=w4(16).key, workload=w4(16).to_json(), target_key=h100.id, schedule=t16,
                      status="ok", latency_us=10.0, device="NVIDIA H100 80GB HBM3"))
    got = d.choose(w4(64), h100)
    assert got.schedule == ScheduleSpace(w4(64), h100).default() and got.source == \
        "default (bucket M=16 skipped: a tile of 16 rows reads the weight 4 times for 64 rows, the default's once)"


def test_a_bucket_farther_than_a_skipped_one_does_not_serve(tmp_path):
    """Where the nearest tuned row count's record is another regime, a record tuned farther away does
    not serve in its place: 128 rows of gate_up skip the 256-row record (a 64-row tile, two passes over
    the weight where the default's 128-row tile makes one) and get the default, not the 4096-row prefill
    record; 2048 rows, nearer to 4096 than to 256, are served the 4096-row record."""
    h100 = get_target("h100")
    w4 = lambda m: flashgen.workload("gemm_w4a16", M=m, N=28672, K=4096, G=128, dtype="bf16")  # noqa: E731
    t64 = {**ScheduleSpace(w4(64), h100).default(), "split_k": 2}
    t128 = {**ScheduleSpace(w4(128), h100).default(), "num_stages": 2}
    db_path = tmp_path / "t.db"
    with Database(db_path) as db:
        for m, s in ((256, t64), (4096, t128)):
            db.add(Record(workload_key=w4(m).key, workload=w4(m).to_json(), target_key=h100.id, schedule=s,
                          status="ok", latency_us=float(m), device="NVIDIA H100 80GB HBM3"))
    d = Dispatcher(h100, db_path)
    got = d.choose(w4(128), h100)
    assert got.schedule == ScheduleSpace(w4(128), h100).default() and got.source == \
        "default (bucket M=256 skipped: a tile of 64 rows reads the weight 2 times for 128 rows, the default's once)"
    assert (d.choose(w4(2048), h100).source, d.choose(w4(2048), h100).schedule) == ("bucket M=4096", t128)


def test_linear_takes_its_norm_gate_and_residual_on_cpu():
    """runtime/decoder/linear.py on CPU tensors: the norm's and the gate's own kernels, torch's product, the
    residual added; equal to the float64 composition."""
    from flashgen.runtime.decoder.linear import apply
    from flashgen.runtime.decoder.quant_modes import prepare
    g = torch.Generator().manual_seed(5)
    w, x, r = torch.randn(48, 96, generator=g), torch.randn(3, 96, generator=g), torch.randn(3, 48, generator=g)
    nw = torch.randn(96, generator=g) * 0.2 + 1
    q = prepare(w, "bf16")
    x64 = x.double()
    normed = x64 * (x64.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt() * nw.double()
    out = apply(x, q, None, set(), norm=nw, eps=1e-6, residual=r)
    assert rel(out, normed @ w.double().T + r.double()) < 1e-5
    xg = torch.randn(3, 192, generator=g)
    gate, up = xg.double().chunk(2, dim=-1)
    out = apply(xg, q, None, set(), gated=True)
    assert rel(out, (gate * torch.sigmoid(gate) * up) @ w.double().T) < 1e-5
    assert q.weight.is_mkldnn  # a float32 CPU weight is held reordered for oneDNN
    for m in (1, 5):  # odd N, a bias, one row
        w7, b7, x7 = torch.randn(77, 96, generator=g), torch.randn(77, generator=g), torch.randn(m, 96, generator=g)
        out = apply(x7, prepare(w7, "bf16"), b7, set())
        assert out.shape == (m, 77) and rel(out, x7.double() @ w7.double().T + b7.double()) < 1e-5


def test_cpu_int8_modes_quantize_activations_and_mixed_picks_per_call():
    """On the CPU, w8a8, w4a8 and fp8 compute as gemm_w8a8, gemm_w4a8 and gemm_fp8 do (x quantized per
    token, the sums scaled per token and per channel), not as the weight-only modes; mixed runs, call by call, the
    mode its chooser picks for M."""
    from flashgen.oplib._common import quantize_ref
    from flashgen.quant import quantize_w4a8, unpack_int4, unpack_int4_lanes
    from flashgen.runtime.decoder.linear import apply
    from flashgen.runtime.decoder.quant_modes import prepare
    g = torch.Generator().manual_seed(6)
    w, x, b = torch.randn(40, 96, generator=g), torch.randn(5, 96, generator=g) * 3, torch.randn(40, generator=g)
    q, fallbacks = prepare(w, "w8a8"), set()
    assert q.weight is None  # no dequantized copy: torch multiplies the int8 codes
    out = apply(x, q, b, fallbacks)
    xq, xs = quantize_ref(x.double(), "int8")
    assert rel(out, (xq @ q.w8.double().T) * xs[:, None] * q.w8_scale.double() + b.double()) < 1e-6
    assert 1e-4 < rel(out, apply(x, prepare(w, "w8a16"), b, set())) < 2e-2  # the activations' rounding
    assert fallbacks == {"w8a8 linear (torch on int8 product of per-token int8 activations on cpu)"}

    # w4a8 (K=80: per channel; K=96: groups of 32; K=256: groups of 128) as gemm_w4a8 computes: an int8
    # operand (u - 8) * s_group
    for k, group in ((80, None), (96, 32), (256, 128)):
        wk, xk = torch.randn(40, k, generator=g), torch.randn(5, k, generator=g) * 3
        q4 = prepare(wk, "w4a8")
        qa = quantize_w4a8(wk, group)
        xq, xs = quantize_ref(xk.double(), "int8")
        y4 = apply(xk, q4, b, fallbacks)
        assert rel(y4, (xq * xs[:, None]) @ qa.dequantize().T + b.double()) < 1e-6
        assert rel(y4, xk.double() @ wk.double().T + b.double()) < 0.2  # 4-bit weights' rounding
    assert fallbacks == {"w8a8 linear (torch on int8 product of per-token int8 activations on cpu)",
                         "w4a8 linear (torch on int8 product of per-token int8 activations on cpu)"}

    # fp8 as gemm_fp8 computes: e4m3 activations per token times e4m3 weights per channel
    from flashgen.quant import quantize_fp8
    for m in (1, 5):
        xm, f8 = x[:m], set()
        xq, xs = quantize_ref(xm.double(), "fp8e4m3")
        y8 = apply(xm, prepare(w, "fp8"), b, f8)
        assert rel(y8, (xq * xs[:, None]) @ quantize_fp8(w).dequantize().T + b.double()) < 1e-5
        assert 1e-3 < rel(y8, xm.double() @ w.double().T + b.double()) < 0.1  # e4m3's 3-bit mantissas
        assert f8 == {"fp8 linear (torch on fp8e4m3 product of per-token fp8e4m3 activations on cpu)"}

    picks, mixed = [], set()
    qm = prepare(w, "mixed")
    modes = {5: "w8a8", 1: "w4a16", 3: "w4a8"}
    chooser = lambda n, k, m: picks.append((n, k, m)) or modes[m]  # noqa: E731
    assert torch.equal(apply(x, qm, b, mixed, chooser), out)
    # both 4-bit modes share one weight, w4a8's (K=96: groups of 32): w4a16 multiplies it dequantized, w4a8
    # as its GEMM does
    qa = quantize_w4a8(w, 32)
    assert rel(apply(x[:1], qm, b, mixed, chooser), x[:1].double() @ qa.dequantize().T + b.double()) < 1e-6
    assert torch.equal(apply(x[:3], qm, b, mixed, chooser), apply(x[:3], prepare(w, "w4a8"), b, set()))
    # (the same codes, each 4-bit linear's in the layout its GEMM reads)
    assert torch.equal(unpack_int4(qm.choices["w4a16"].w4, 96), unpack_int4_lanes(qm.choices["w4a8"].w4, 96))
    assert picks == [(40, 96, 5), (40, 96, 1), (40, 96, 3)]
    assert mixed == fallbacks | {"w4a16 linear (torch on the dequantized weight on cpu)"}


def test_bucket_passes_over_a_stale_top_record(tmp_path):
    """A bucket's fastest record whose schedule today's space refuses gives way to that workload's next
    record, as the exact lookup does, instead of hiding the workload from every nearby M."""
    h200 = get_target("h200")
    db_path = tmp_path / "t.db"
    stale = {"block_r": 4, "block_c": 1024, "num_warps": 3}  # num_warps=3: no space admits it today
    valid = {"block_r": 4, "block_c": 1024, "num_warps": 4}
    wl64 = flashgen.workload("rmsnorm", M=64, N=1000, dtype="bf16")
    assert not ScheduleSpace(wl64, h200).is_valid(stale) and ScheduleSpace(wl64, h200).is_valid(valid)
    with Database(db_path) as db:
        _record(db, wl64, stale, 1.0)
        _record(db, wl64, valid, 3.0)
    d = Dispatcher(h200, db_path)
    for m in (64, 40):
        got = d.choose(flashgen.workload("rmsnorm", M=m, N=1000, dtype="bf16"), h200)
        assert (got.source, got.schedule) == ("exact" if m == 64 else "bucket M=64", valid)


def test_bucket_prefers_the_nearest_other_row_dims(tmp_path):
    """Decode records of one batch size tuned at several contexts: a call takes the nearest context's
    schedule, whichever record the database lists first; the cache's size (NB, MAXB) does not count."""
    h200 = get_target("h200")
    dims = dict(Hq=32, Hkv=8, D=128, BS=16, dtype="bf16")
    near = {"pages": 2, "num_warps": 4, "num_stages": 2, "splits": 8}
    far = {"pages": 8, "num_warps": 4, "num_stages": 2, "splits": 32}
    for order in ((far, near), (near, far)):
        db_path = tmp_path / f"{len(list(tmp_path.iterdir()))}.db"
        with Database(db_path) as db:
            for s in order:
                length = 131072 if s is far else 4096
                wl = flashgen.workload("paged_decode_attention", B=1, NB=length // 16, MAXB=length // 16, L=length, **dims)
                _record(db, wl, s, 5.0)
        call = flashgen.workload("paged_decode_attention", B=1, NB=700, MAXB=512, L=8192, **dims)
        d = Dispatcher(h200, db_path).choose(call, h200)
        assert (d.source, d.schedule) == ("bucket B=1", near)
        call = flashgen.workload("paged_decode_attention", B=1, NB=20000, MAXB=16384, L=131072 * 2, **dims)
        assert Dispatcher(h200, db_path).choose(call, h200).schedule == far

    # the cache's and the tables' sizes do not count: the decoder's 288-token contexts dispatch at L=512
    # in a cache of 293 blocks, and take the record tuned at L=512 in a cache 28 times larger
    short = {"pages": 1, "num_warps": 4, "num_stages": 2, "splits": 4}
    with Database(tmp_path / "short.db") as db:
        _record(db, flashgen.workload("paged_decode_attention", B=16, NB=8192, MAXB=512, L=512, **dims), short, 5.0)
        _record(db, flashgen.workload("paged_decode_attention", B=16, NB=293, MAXB=292, L=4096, **dims), far, 5.0)
    call = flashgen.workload("paged_decode_attention", B=16, NB=293, MAXB=292, L=512, **dims)
    assert Dispatcher(h200, tmp_path / "short.db").choose(call, h200).schedule == short


def test_mixed_estimates_read_the_database_once_per_state(tmp_path, monkeypatch):
    """The mixed mode estimates every mode at every row count of every layer shape: the records are read
    once, and again only after the database changed (a faster record changes the estimate), while
    dispatch's buckets share them."""
    from flashgen.runtime.decoder.mixed import estimate

    reads = []
    best_all = Database.best_all
    monkeypatch.setattr(Database, "best_all", lambda self, *a, **k: reads.append(1) or best_all(self, *a, **k))
    db_path, h200 = tmp_path / "t.db", get_target("h200")
    w8 = flashgen.workload("gemm_w8a8", M=16, N=1000, K=768, dtype="bf16")
    s8 = ScheduleSpace(w8, h200).default()  # served: valid today
    with Database(db_path) as db:
        _record(db, w8, s8, 14.0)
    # (M=3 looks for an exact record on both devices of the architecture before the H200's bucket)
    assert [estimate(w8.with_dims(M=m), h200, db_path).us for m in (3, 16, 3, 16)] == [14.0] * 4
    assert len(reads) == 2
    d = Dispatcher(h200, db_path)
    for _ in range(2):  # a bucket lookup: both devices' records as read above
        d.choose(flashgen.workload("rmsnorm", M=40, N=1000, dtype="bf16"), h200)
        assert len(reads) == 2
    with Database(db_path) as db:
        _record(db, w8, {**s8, "num_stages": 3 if s8["num_stages"] != 3 else 2}, 7.0)
    assert [estimate(w8.with_dims(M=m), h200, db_path).us for m in (3, 16)] == [7.0] * 2
    assert len(reads) == 4


def test_mixed_estimate_of_a_rowwise_kernel_scales_with_rows_above_its_launch(tmp_path):
    """A rowwise kernel's estimate below its smallest measured rows shrinks with its rows (its bytes),
    but never under the fastest record of its op at any shape (what its launch costs); with no record
    of its own shape, the larger of its roofline and that floor. A GEMM's stays flat below (its weight)."""
    from flashgen.roofline import roofline_us
    from flashgen.runtime.decoder.mixed import estimate

    db_path, h200 = tmp_path / "t.db", get_target("h200")
    silu = lambda m, n: flashgen.workload("silu_mul", M=m, N=n, dtype="bf16")  # noqa: E731
    with Database(db_path) as db:
        for wl, us in ((silu(512, 1000), 12.8), (silu(1, 300), 1.5)):
            _record(db, wl, ScheduleSpace(wl, h200).default(), us)
    assert estimate(silu(256, 1000), h200, db_path).us == pytest.approx(6.4)
    assert estimate(silu(16, 1000), h200, db_path).us == pytest.approx(1.5)  # 0.4 by rows: the launch's
    lone = silu(16, 777)
    assert roofline_us(lone, h200) < 0.1
    assert estimate(lone, h200, db_path).us == pytest.approx(1.5) and estimate(lone, h200, db_path).source == "roofline"
    w8 = flashgen.workload("gemm_w8a8", M=512, N=1000, K=768, dtype="bf16")
    with Database(db_path) as db:
        _record(db, w8, ScheduleSpace(w8, h200).default(), 20.0)
    assert estimate(w8.with_dims(M=64), h200, db_path).us == pytest.approx(20.0)


def test_warm_start_compiles_nothing(monkeypatch):
    """A second process-like dispatcher finds the kernel in the artifact cache: no Triton compile."""
    x, w = torch.randn(8, 3072, dtype=torch.bfloat16), torch.randn(3072, dtype=torch.bfloat16)
    Dispatcher("h100").kernel("rmsnorm", {"x": x, "w": w})
    import flashgen.targets.triton as backend

    def refuse(*a, **k):
        raise AssertionError("compiled again")
    monkeypatch.setattr(backend, "compile_aot", refuse)
    k = Dispatcher("h100").kernel("rmsnorm", {"x": x[:3], "w": w})
    assert k.binary[:4] == b"\x7fELF"


def test_dims_not_in_shapes_must_be_given():
    x = torch.randn(2, 64, dtype=torch.float16)
    with pytest.raises(flashgen.FlashgenError, match="cannot be read off"):
        Dispatcher("h100").kernel("gemm_w4a16", {"x": x, "w_packed": torch.zeros(16, 8, dtype=torch.int32),
                                                "scales": torch.ones(16, 2, dtype=torch.float16)})


def test_decode_graph_buckets_and_padding():
    from flashgen.runtime.decoder.decode_graphs import bucket_for, buckets, input_columns, padded_inputs
    assert buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256] and buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert buckets(1) == [1]
    sizes = buckets(48)
    assert [bucket_for(n, sizes) for n in (1, 3, 4, 5, 33, 48, 49)] == [1, 4, 4, 8, 48, 48, None]
    assert [input_columns(b) for b in (1, 2, 3, 48)] == [2, 2, 4, 48]   # rows of int64 start 16-byte aligned
    assert padded_inputs([7, 8], [10, 0], [33, 50], 4, 96) == [[7, 8, 0, 0], [10, 0, 0, 0], [33, 50, 96, 96],
                                                                 [11, 1, 1, 1]]


class _Stepper:
    """A decoder stand-in for `DecodeGraphs`: the real context buckets and table width of tiny (a
    1024-token window), a forward whose greedy token is the input token + 1, noting what each call saw."""

    def __init__(self):
        from flashgen.runtime.decoder.bench import CONFIGS
        from flashgen.runtime.decoder.model import Decoder
        self.model = Decoder.__new__(Decoder)
        self.model.c, self.model.device = CONFIGS["tiny"], torch.device("cpu")
        self.device, self.seen = self.model.device, []

    def table_width(self, cache):
        return self.model.table_width(cache)

    def attention_context(self, longest, cache):
        return self.model.attention_context(longest, cache)

    def forward(self, batch, cache):
        self.seen.append((batch.context, batch.tokens.tolist(), batch.tables.clone()))
        return torch.nn.functional.one_hot((batch.tokens + 1) % 256, 256).float()


class _Replayed:
    """A CUDA graph stand-in: a replay calls the step again and writes into the captured outputs."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        for kept, new in zip(self.out, self.fn()):
            kept.copy_(new)


def test_decode_graphs_capture_each_context_bucket_and_chain_across_a_capture(monkeypatch):
    """The real `DecodeGraphs` bookkeeping with eager stand-ins for capture and replay: a step is
    captured at its longest context's bucket; chained steps (tokens=None) read the tokens the last
    replay left in the batch size's inputs, also when the step crosses into a new bucket and its capture
    (over padding) runs in between; the tables are loaded again after a capture; `chosen` is the last
    replay's; `prepare` captures every bucket up to a context."""
    from flashgen.runtime.decoder import decode_graphs
    from flashgen.runtime.decoder.kv_cache import PagedKVCache
    monkeypatch.setattr(decode_graphs, "cuda_graph", lambda fn, dev, pool: (lambda out: (_Replayed(fn, out), out))(fn()))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    model = _Stepper()
    cache = PagedKVCache(1, 80, 16, 1, 8, torch.float32, torch.device("cpu"), pad_block=True)
    for seq, n in ((0, 540), (1, 520)):
        cache.manager.reserve(seq, n)
    graphs = decode_graphs.DecodeGraphs(model, cache)
    tables = torch.tensor(cache.manager.padded_tables([0, 1], graphs.width, 2), dtype=torch.int32)
    replays = []
    for positions, tokens in (([500, 480], [5, 9]), ([510, 490], None), ([511, 491], None), ([512, 492], None),
                              ([513, 493], None)):
        graphs.run([0, 1], tokens, positions, [0, 0])
        replays.append(model.seen[-1])
    assert [r[0] for r in replays] == [512, 512, 512, 1024, 1024]
    assert [r[1] for r in replays] == [[5, 9], [6, 10], [7, 11], [8, 12], [9, 13]]
    assert all(torch.equal(r[2], tables) for r in replays)
    captures = [seen for seen in model.seen if seen not in replays]
    assert [c[0] for c in captures] == [512, 1024] and all(c[1] == [0, 0] for c in captures)  # over padding
    assert sorted(graphs.graphs[2].replays) == [512, 1024] and graphs.chosen(2).tolist() == [10, 14]
    fresh = decode_graphs.DecodeGraphs(model, cache)
    fresh.prepare(3, 5000)
    assert sorted(fresh.graphs[4].replays) == [512, 1024]  # the window (1024) bounds the buckets


@pytest.mark.parametrize("vocab", [128256, 256, 1031, 3000])
def test_greedy_is_argmax_with_first_index_on_ties(vocab):
    """The two-reduction greedy choice against torch.argmax on fresh random rows, bf16 (many ties among
    the top values), a prime vocabulary (chunks of one) and a row whose maximum repeats in other chunks."""
    from flashgen.runtime.decoder.decode_graphs import NON_FINITE, greedy
    g = torch.Generator().manual_seed(vocab)
    for rows in (1, 3, 64):
        x = (torch.randn(rows, vocab, generator=g) * 4).to(torch.bfloat16)
        x[0, vocab // 3] = x[0, vocab - 1] = x[0, 1] = x[0].max() + 1  # ties across chunks: the first wins
        assert torch.equal(greedy(x), x.argmax(-1)), rows
        assert greedy(x).dtype == torch.int64 and greedy(x)[0] == 1
        if rows == 3:  # a NaN anywhere or a +inf marks its row; a -inf is a token never chosen
            y = x.clone()
            y[0, vocab - 2], y[1, 7 % vocab], y[2, 0] = math.nan, math.inf, -math.inf
            assert greedy(y).tolist() == [NON_FINITE, NON_FINITE, x[2].argmax().item()]


def test_pad_block_is_never_handed_out_and_pads_tables():
    from flashgen.runtime.decoder.kv_cache import BlockManager
    m = BlockManager(4, 16, pad_block=True)  # four blocks to hand out, and the pad block after them
    assert m.pad == 4 and m.reserve(0, 40) == [0, 1, 2] and m.reserve(1, 16) == [3]
    assert not m.can_hold(2, 1)                                          # the pad block is not free
    assert m.padded_tables([1, 0], 4, rows=4) == [[3, 0, 0, 0], [0, 1, 2, 0], [4, 4, 4, 4], [4, 4, 4, 4]]
    with pytest.raises(flashgen.FlashgenError, match="more than the table width"):
        m.padded_tables([0], 2)
    m.release(0)
    assert sorted(m.free) == [0, 1, 2]
    plain = BlockManager(5, 16)
    assert plain.pad is None and len(plain.free) == 5
    plain.reserve(0, 16)
    assert plain.padded_tables([0], 3) == [[0, 0, 0]]
    with pytest.raises(flashgen.FlashgenError, match="pad block"):
        plain.padded_tables([0], 3, rows=2)


def test_outgrown_scratch_stays_alive():
    """A CUDA graph captured with a split-KV decode's scratch keeps writing there after a larger batch
    replaced it: the old buffer must not be freed."""
    import gc
    import weakref

    from flashgen.targets.triton.codegen import generate
    from flashgen.targets.triton.launch import TritonLauncher
    wl = flashgen.workload("paged_decode_attention", B=1, Hq=8, Hkv=2, D=64, BS=16, NB=64, MAXB=8, L=128,
                           dtype="fp16")
    schedule = {"pages": 2, "num_warps": 4, "num_stages": 2, "splits": 4}
    launcher = TritonLauncher(generate(wl, schedule), wl, get_target("h100"))
    cpu = torch.device("cpu")
    small = launcher.scratch("part_acc", wl.dim, cpu)
    alive = weakref.ref(small)
    assert launcher.scratch("part_acc", wl.dim, cpu) is small
    big = launcher.scratch("part_acc", {**wl.dim, "B": 3}, cpu)
    assert big.numel() >= 3 * small.numel()
    assert launcher.scratch("part_acc", {**wl.dim, "B": 2}, cpu) is big
    del small
    gc.collect()
    assert alive() is not None


def test_launch_refuses_views_the_binary_cannot_read():
    """Binaries assume 16-byte aligned tensors and strides that are multiples of 16 elements (where the
    contiguous ones are): a view at an odd offset or with an odd row stride is refused with the reason,
    while a view that keeps both (the q columns of a fused qkv output) launches."""
    from flashgen.targets.triton.codegen import generate
    from flashgen.targets.triton.launch import TritonLauncher
    wl = flashgen.workload("rope", M=4, Hq=2, Hkv=1, D=32, L=16, dtype="fp16")
    launcher = TritonLauncher(generate(wl, ScheduleSpace(wl, get_target("h100")).default()), wl, get_target("h100"))
    qkv = torch.zeros(4, 4 * 32 + 8, dtype=torch.float16)
    outs = {"q_out": torch.empty(4, 2, 32, dtype=torch.float16), "k_out": torch.empty(4, 1, 32, dtype=torch.float16)}
    rest = {"positions": torch.zeros(4, dtype=torch.int64), "cos_sin": torch.zeros(16, 32)}

    def args(q, k):
        return launcher.args({"q": q, "k": k, **rest, **outs}, {}, wl.dim)

    wide = torch.zeros(4, 4 * 32, dtype=torch.float16)
    assert len(args(wide[:, :64].reshape(4, 2, 32), wide[:, 64:96].reshape(4, 1, 32))) == len(launcher.ks.args)
    with pytest.raises(flashgen.FlashgenError, match="address that is not a multiple of 16"):
        args(qkv[:, 1:65].reshape(4, 2, 32), wide[:, 64:96].reshape(4, 1, 32))
    with pytest.raises(flashgen.FlashgenError, match="stride 136"):
        args(qkv[:, :64].reshape(4, 2, 32), wide[:, 64:96].reshape(4, 1, 32))
