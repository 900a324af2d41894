"""The TVM backend on the cpu target: every op compiled with LLVM and run for real on CPU tensors,
against the float64 reference on fresh random inputs; artifacts, dynamic M, params, layouts, timing."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from flashgen.check import check
from flashgen.errors import FlashgenError
from flashgen.oplib import OPS

# the row ops over an [M, N] domain (moe_route's [M, E] comes in through numerics_cases and NARROW)
ROW_OPS = [name for name, o in OPS.items() if o.kclass in ("rowwise", "pointwise") and {"M", "N"} <= set(o.dims)]
from flashgen.schedules.row_space import CPU_MAX_BLOCK_C
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from flashgen.workload import Workload, domain, workload
from tests.cases import case_id, numerics_cases

tvm_backend = pytest.importorskip("flashgen.targets.tvm_backend")
from flashgen.targets.tvm_backend import lower

CPU = get_target("cpu")
_KERNELS: dict = {}


def kernel(wl: Workload, schedule: dict | None = None):
    """Build once per (workload, schedule) for the whole module."""
    schedule = schedule or ScheduleSpace(wl, CPU).default()
    key = (wl, json.dumps(schedule, sort_keys=True))
    if key not in _KERNELS:
        _KERNELS[key] = tvm_backend.build(wl, schedule, CPU)
    return _KERNELS[key]


def run_check(wl: Workload, schedule: dict | None = None, seed: int = 0, built_for: Workload | None = None):
    """check() through the launcher of the kernel built for `built_for` (default: `wl` itself)."""
    k = kernel(built_for or wl, schedule)
    checks = check(wl, lambda ins, outs, p: k.launcher({**ins, **outs}, p, wl.dim), seed)
    assert {c.tensor for c in checks} == {t.name for t in wl.outputs} | {t.name for t in wl.inputs if t.written}
    return checks


# Every op over M in {1, 3, 17} x N in {1, 127, 5120, 11008}, dtypes cycling fp32/bf16/fp16 across the
# shapes (so every op meets each), int8 quant outputs; rope at the brief's small shape in fp32 and bf16.
# The row ops over half of that grid, a checkerboard turning with the op (each op meets every M, N and
# dtype; the interpreter, tests/test_interpreter_numerics.py, runs the whole grid). moe_route once per
# expert count (M turning with E), each at top-2, top-8 and sigmoid_bias top-8 (about 2 s a build).
GRID = ((1, 3, 17), (1, 127, 5120, 11008))


def _kept(wl: Workload) -> bool:
    if wl.op_name in ROW_OPS:  # (the checkerboard)
        return (GRID[0].index(wl.dim["M"]) + GRID[1].index(wl.dim["N"]) + ROW_OPS.index(wl.op_name)) % 2 == 0
    if wl.op_name == "moe_route":
        return (1, 3, 17).index(wl.dim["M"]) == (8, 60, 128).index(wl.dim["E"])
    return True


CASES = [wl for wl in numerics_cases(*GRID, dtypes=("fp32", "bf16", "fp16"), quant_out=("int8",)) if _kept(wl)]
CASES += [workload("rope", M=m, Hq=4, Hkv=2, D=64, L=50, style=s, dtype=dt)
          for m, dt in ((3, "fp32"), (17, "bf16")) for s in ("neox", "gptj")]
CASES += [workload("rope_cache_partial", M=m, Hq=4, Hkv=2, D=80, R=32, L=50, NS=20, style=s, dtype=dt)
          for m, dt, s in ((3, "fp32", "gptj"), (17, "bf16", "neox"))]
CASES += [workload(op, M=17, N=5120, dtype=dt, **({"out_dtype": "int8"} if "quant" in op else {}))
          for op in ROW_OPS if not op.startswith("rope") for dt in ("fp32", "bf16")]
# weights dequantized (the ops over a weight's N x K): int4 codes with zero points and a padded last
# block of 128 k, per-channel scales, int8 codes
CASES += [workload("dequant_w4a16", N=33, K=320, G=64, zp="asym", dtype="bf16"),
          workload("dequant_w4a16", N=7, K=256, G=256, group="channel", dtype="fp16"),
          workload("dequant_w8a16", N=17, K=200, dtype="bf16")]
# a row that keeps a value for a later pass in a buffer TVM takes from its workspace (over 1 KiB), in
# tasks run in parallel (70 rows of 1000: over PARALLEL_MIN_ELEMENTS)
CASES += [workload("softmax", M=70, N=1000, dtype="bf16")]


def test_cases_cover_the_brief():
    seen = {(wl.op_name, wl.dtype) for wl in CASES}
    for op in ROW_OPS:
        assert {(op, "fp32"), (op, "bf16")} <= seen, op
    assert {wl.dim.get("M") for wl in CASES} >= {1, 3, 17}
    assert {wl.dim.get("N") for wl in CASES} >= {1, 127, 5120, 11008}
    assert {wl.attr["out_dtype"] for wl in CASES if "out_dtype" in wl.attr} == {"int8"}


@pytest.mark.parametrize("wl", CASES, ids=case_id)
def test_default_schedule(wl):
    for c in run_check(wl, seed=len(case_id(wl))):
        assert c.ok, c


ROWWISE = [op for op in ROW_OPS if OPS[op].kclass == "rowwise"]
# Narrow tiles: 5120 = 320 x 16 (many passes over full tiles), 127 = 7 x 16 + 15 (a ragged end),
# 17 rows in tasks of 4 (a ragged last task); and the widest tile the cpu space allows.
NARROW = [workload(op, M=17, N=n, dtype=dt, **({"out_dtype": "int8"} if "quant" in op else {}))
          for op in ROWWISE for n, dt in ((5120, "bf16"), (127, "fp32"))]
NARROW += [workload("moe_route", M=17, E=e, topk="8", renorm=rn, dtype=dt)
           for e, rn, dt in ((128, "yes", "bf16"), (60, "no", "fp32"))]


@pytest.mark.parametrize("wl", NARROW, ids=case_id)
def test_narrow_tiles_multi_pass(wl):
    schedule = {"block_r": 4, "block_c": 16, "num_warps": 1}
    assert ScheduleSpace(wl, CPU).is_valid(schedule) and schedule != ScheduleSpace(wl, CPU).default()
    src = kernel(wl, schedule).source
    assert "T.vectorized(16)" in src and "rb * 4 + ri" in src
    for c in run_check(wl, schedule, seed=3):
        assert c.ok, c


@pytest.mark.parametrize("wl", [workload("softmax", M=3, N=5120, dtype="fp16"),
                                workload("silu_mul", M=17, N=11008, dtype="bf16"),
                                workload("rope", M=17, Hq=4, Hkv=2, D=64, L=50, style="gptj", dtype="fp16")],
                         ids=case_id)
def test_widest_tiles(wl):
    schedule = {"block_r": 2, "block_c": CPU_MAX_BLOCK_C, "num_warps": 1}
    assert ScheduleSpace(wl, CPU).is_valid(schedule)
    for c in run_check(wl, schedule, seed=4):
        assert c.ok, c


def test_one_kernel_serves_any_m():
    """M is a runtime variable: the kernel built for M=4 runs M=1, 17 and 600, through the launcher
    and through Kernel.__call__ (which reads M off the tensors). 600 rows of 127 take the parallel
    loop, fewer the serial one."""
    built = workload("rmsnorm_quant", M=4, N=127, dtype="bf16", out_dtype="int8")
    schedule = {"block_r": 4, "block_c": 32, "num_warps": 1}
    src = kernel(built, schedule).source
    assert "if M < 517:" in src and "for rb in T.serial((M + 3) // 4)" in src and "T.parallel((M + 3) // 4)" in src
    for m in (1, 17, 600):
        for c in run_check(built.with_dims(M=m), schedule, seed=m, built_for=built):
            assert c.ok, (m, c)
    k = kernel(built, schedule)
    x = torch.randn(9, 127).bfloat16()
    w = torch.randn(127).bfloat16()
    q, scale = k(x, w)
    assert q.shape == (9, 127) and scale.shape == (9,)
    ref = built.op.reference({"x": x, "w": w}, built.op.params, {"M": 9, "N": 127}, built.attr)
    assert (q.double() - ref["q"]).abs().max() <= 1
    torch.testing.assert_close(scale.double(), ref["scale"], rtol=1e-5, atol=0)


def test_rint_is_half_to_even():
    """absmax 127 gives scale 1, so x / scale hits exact .5 ties: int8 must round them to even."""
    wl = workload("dynamic_quant", M=2, N=8, dtype="fp32", out_dtype="int8")
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5],
                      [-127.0, 4.5, 5.5, -4.5, 126.5, -126.5, 0.49999997, 1.0]])
    q, scale = kernel(wl)(x)
    assert torch.equal(scale, torch.ones(2))
    assert torch.equal(q, torch.round(x).to(torch.int8)), q  # torch.round is half to even
    assert q[0, 1:4].tolist() == [0, 2, 2]


def test_params_are_runtime_arguments():
    for op, params, kw in (("rmsnorm", {"eps": 0.25}, {}), ("softmax", {"temperature": 0.3}, {}),
                           ("layernorm", {"eps": 2.0}, {})):
        wl = workload(op, M=5, N=300, dtype="fp32", **kw)
        k = kernel(wl)
        ins = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(0))
        got = k(*[ins[t.name] for t in wl.op.inputs], **params)
        ref = wl.op.reference(ins, {**wl.op.params, **params}, wl.dim, wl.attr)["y"]
        default = wl.op.reference(ins, wl.op.params, wl.dim, wl.attr)["y"]
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got.double(), default, rtol=1e-3, atol=1e-3), op


def test_non_contiguous_tensors():
    wl = workload("add_rmsnorm", M=6, N=40, dtype="bf16")
    k = kernel(wl)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 6, generator=g).bfloat16().t()            # strided input
    res = torch.randn(6, 80, generator=g).bfloat16()[:, ::2]       # every other column
    w = torch.randn(40, generator=g).bfloat16()
    y = torch.full((40, 6), float("nan")).bfloat16().t()           # strided output
    r_out = torch.empty(6, 40).bfloat16()
    k.launcher({"x": x, "residual": res, "w": w, "y": y, "residual_out": r_out}, {"eps": 1e-6}, wl.dim)
    ref = wl.op.reference({"x": x, "residual": res, "w": w}, wl.op.params, wl.dim, wl.attr)
    torch.testing.assert_close(y.double(), ref["y"], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(r_out.double(), ref["residual_out"], rtol=1e-2, atol=1e-2)


def test_nan_propagates_through_bf16_stores():
    wl = workload("silu_mul", M=2, N=64, dtype="bf16")
    x = torch.randn(2, 128).bfloat16()
    x[1, 70] = float("nan")  # the "up" half of column 6 of row 1
    y = kernel(wl)(x)
    assert torch.isnan(y[1, 6]) and torch.isfinite(y[0]).all() and torch.isnan(y).sum() == 1


def test_shape_mismatch_is_an_error():
    wl = workload("rmsnorm", M=4, N=64, dtype="fp32")
    k = kernel(wl)
    with pytest.raises(FlashgenError):
        k(torch.randn(4, 65), torch.randn(65))
    y = torch.empty(4, 64)
    with pytest.raises(Exception, match="shape"):  # the compiled function checks its arguments too
        k.launcher({"x": torch.randn(4, 64), "w": torch.randn(63), "y": y}, {"eps": 1e-6}, wl.dim)


def test_source_and_artifacts():
    wl = workload("rmsnorm", M=8, N=5120, dtype="bf16")
    k = kernel(wl)
    src = k.source
    assert src.startswith("# flashgen: rmsnorm") and "from tvm.script import tirx as T" in src
    assert "@T.prim_func" in src and "M = T.int64()" in src and "(M, 5120)" in src
    assert "T.parallel(" in src and "T.vectorized(64)" in src and "eps: T.float32" in src
    assert k.binary_kind == "so" and k.binary[:4] == b"\x7fELF"
    assert "define" in k.asm["llvm"] and k.asm.get("s")
    meta = k.metadata
    assert meta["backend"] == "tvm" and meta["tools"]["tvm"] and meta["entry"] == k.name == "rmsnorm_kernel"
    assert [a["name"] for a in meta["signature"]] == ["x_h", "w_h", "y_h", "eps"]


def test_saved_kernel_reloads_and_runs(tmp_path):
    wl = workload("rope", M=5, Hq=4, Hkv=2, D=64, L=50, style="neox", dtype="bf16")
    k = kernel(wl)
    written = {p.name for p in k.save(tmp_path)}
    assert {"rope_kernel.so", "rope_kernel.tvm.py", "rope_kernel.json", "rope_kernel.llvm"} <= written
    meta = json.loads((tmp_path / "rope_kernel.json").read_text())
    assert meta["backend"] == "tvm" and meta["sha256"]["rope_kernel.so"]
    assert (tmp_path / "rope_kernel.tvm.py").read_text() == k.source
    binary = (tmp_path / "rope_kernel.so").read_bytes()
    launcher = tvm_backend.launcher_from_binary(wl, meta, binary)
    for c in check(wl, lambda i, o, p: launcher({**i, **o}, p, wl.dim), seed=9):
        assert c.ok, c
    with pytest.raises(FlashgenError, match="does not match the sha256"):
        tvm_backend.launcher_from_binary(wl, meta, binary[:-1])
    other = {**meta, "tools": {**meta["tools"], "tvm": "0.1.0"}}
    with pytest.raises(FlashgenError, match="built by TVM 0.1.0, and this is TVM"):
        tvm_backend.launcher_from_binary(wl, other, binary)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("sha256"), "records no sha256 of rmsnorm_kernel.so, so nothing says the binary is whole"),
    (lambda m: m.update(sha256="x"), "records no sha256 of rmsnorm_kernel.so"),
    (lambda m: m["sha256"].pop("rmsnorm_kernel.so"), "records no sha256 of rmsnorm_kernel.so"),
    (lambda m: m.pop("entry"), "the kernel JSON names no entry"),
    (lambda m: m.pop("workload"), "the kernel JSON of rmsnorm_kernel records no workload"),
    (lambda m: m["workload"]["dims"].update(N=128), 'was compiled for {"attrs": {"dtype": "fp32"}, "dims": {"M": 8, '
                                                     '"N": 128}, "op": "rmsnorm"}, not for rmsnorm M=8 N=64'),
    (lambda m: m["workload"]["attrs"].update(dtype="bf16"), "was compiled for .*bf16.*, not for rmsnorm"),
    (lambda m: m.update(tools=None), "this kernel was built by TVM None"),
    (lambda m: m.update(signature=[{"x": 1}]), "the kernel JSON's signature of rmsnorm_kernel is malformed"),
    (lambda m: m.update(signature=3), "the kernel JSON's signature of rmsnorm_kernel is malformed"),
])
def test_a_saved_kernel_its_json_does_not_vouch_for_is_refused(tmp_path, edit, message):
    """A JSON without the .so's sha256 let a cut-short binary load; another workload's JSON ran a kernel
    whose dims are compiled in; malformed fields were KeyError/TypeError tracebacks: each is one line.
    A row dim (M) other than the compiled one loads, as a call's would."""
    wl = workload("rmsnorm", M=8, N=64, dtype="fp32")
    kernel(wl).save(tmp_path)
    meta = json.loads((tmp_path / "rmsnorm_kernel.json").read_text())
    binary = (tmp_path / "rmsnorm_kernel.so").read_bytes()
    tvm_backend.launcher_from_binary(wl.with_dims(M=3), meta, binary)
    edit(meta)
    with pytest.raises(FlashgenError, match=message) as e:
        tvm_backend.launcher_from_binary(wl, meta, binary[:-100] if "sha256" in message else binary)
    assert "\n" not in str(e.value)


def _counting_compiles(monkeypatch) -> list:
    """Calls of TVM's compile from now on (the backend imports llvm.py's functions at each build)."""
    llvm, calls = sys.modules["flashgen.targets.tvm_backend.llvm"], []
    real = llvm.compile_module
    monkeypatch.setattr(llvm, "compile_module", lambda *a, **k: calls.append(a[0].name) or real(*a, **k))
    return calls


def test_a_second_build_comes_from_the_cache_and_a_damaged_one_is_rebuilt(monkeypatch, tmp_path):
    """The .so, LLVM IR and assembly of a build are cached under its script, LLVM target and tool
    versions: the same kernel again compiles nothing and computes the same; a cached .so cut short, or a
    record rewritten under a matching manifest, is built again with one warning."""
    from flashgen.targets import artifacts
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(tmp_path))
    calls = _counting_compiles(monkeypatch)
    wl = workload("rmsnorm", M=6, N=96, dtype="bf16")
    sched = ScheduleSpace(wl, CPU).default()
    x, w = torch.randn(6, 96).bfloat16(), torch.randn(96).bfloat16()
    first = tvm_backend.build(wl, sched, CPU)
    y = first.run({"x": x, "w": w})["y"]
    again = tvm_backend.build(wl, sched, CPU)
    assert calls == ["rmsnorm_kernel"]
    assert ((again.binary, again.asm, again.source, again.metadata)
            == (first.binary, first.asm, first.source, first.metadata))
    assert torch.equal(again.run({"x": x, "w": w})["y"], y)
    folder = artifacts.entry(first.metadata["cache_key"])
    so = folder / "rmsnorm_kernel.so"
    so.write_bytes(so.read_bytes()[:-64])
    with pytest.warns(UserWarning, match=r"rmsnorm_kernel.so\) that does not match its recorded sha256"):
        rebuilt = tvm_backend.build(wl, sched, CPU)
    assert calls == ["rmsnorm_kernel"] * 2 and torch.equal(rebuilt.run({"x": x, "w": w})["y"], y)
    (folder / "flashgen.json").write_text("{}")
    manifest = json.loads((folder / artifacts.MANIFEST).read_text())
    manifest["flashgen.json"] = hashlib.sha256(b"{}").hexdigest()
    (folder / artifacts.MANIFEST).write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match="unreadable flashgen.json"):
        tvm_backend.build(wl, sched, CPU)
    assert len(calls) == 3


_WARM_CHILD = """
import sys, torch
import flashgen.targets.tvm_backend as backend
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from flashgen.workload import workload
wl, cpu = workload("silu_mul", M=3, N=160, dtype="fp32"), get_target("cpu")
k = backend.build(wl, ScheduleSpace(wl, cpu).default(), cpu)
g, u = torch.randn(3, 320).chunk(2, -1)
print(torch.allclose(k.run({"x": torch.cat([g, u], -1)})["y"], torch.nn.functional.silu(g) * u), "tvm" in sys.modules)
"""


def test_a_cached_kernel_loads_and_runs_without_importing_tvm(tmp_path):
    """What makes a warm start quick: a process whose kernels are all cached never imports the tvm
    package (seconds of Python modules), only TVM's libraries through tvm_ffi."""
    env = {**os.environ, "FLASHGEN_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", _WARM_CHILD], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert [r.stdout.split() for r in runs] == [["True", "True"], ["True", "False"]], runs[-1].stderr


def test_timing():
    wl = workload("softmax", M=64, N=1024, dtype="fp32")
    k = kernel(wl)
    ins = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(0))
    y = torch.empty(64, 1024)
    times = k.launcher.time({**ins, "y": y}, {"temperature": 1.0}, wl.dim, number=5, repeat=3)
    assert len(times) == 3 and all(0 < t < 1.0 for t in times)
    torch.testing.assert_close(y, torch.softmax(ins["x"], -1))  # the timed runs wrote the output


def test_cpu_schedule_space():
    wl = workload("layernorm", M=17, N=11008, dtype="bf16")
    space = ScheduleSpace(wl, CPU)
    default = space.default()
    assert space.is_valid(default) and default["num_warps"] == 1
    schedules = list(space)
    assert schedules and all(s["num_warps"] == 1 and s["block_c"] <= CPU_MAX_BLOCK_C for s in schedules)
    assert "num_warps" in space.why_invalid({**default, "num_warps": 4})
    assert space.why_invalid({**default, "block_c": 256})
    small = ScheduleSpace(workload("rmsnorm", M=64, N=1), CPU).default()
    assert small["block_c"] == 1 and small["block_r"] > 1 and domain(workload("rmsnorm", M=64, N=1)) == (64, 1)


@pytest.mark.parametrize("with_erf", [False, True])
def test_every_expression_node_lowers(monkeypatch, with_erf):
    """A synthetic pointwise op applying every unary function, comparison and index operation of the IR
    (one fp32 output each), registered for this test only, against float64 torch. erf cannot be
    vectorized, so with it the column loop runs serially; without it everything is vectorized."""
    from flashgen.ir import expr as E
    from flashgen.ir.op import Let, Op, Store, TensorSpec
    from flashgen.oplib import _common

    r, c, M, N = _common.r, _common.c, _common.M, _common.N
    x = E.Ref("x")
    funcs = {  # name -> (IR expression of x, float64 torch reference of x)
        "exp": (E.exp(x), torch.exp), "log": (E.log(E.absolute(x) + 1), lambda t: torch.log(t.abs() + 1)),
        "sqrt": (E.sqrt(E.absolute(x)), lambda t: t.abs().sqrt()),
        "rsqrt": (E.rsqrt(E.absolute(x) + 0.5), lambda t: (t.abs() + 0.5).rsqrt()),
        "sigmoid": (E.sigmoid(x), torch.sigmoid), "tanh": (E.tanh(x), torch.tanh), "erf": (E.erf(x), torch.erf),
        "cos": (E.Unary("cos", x), torch.cos), "sin": (E.Unary("sin", x), torch.sin), "neg": (-x, torch.neg),
        "rint": (E.rint(x * 4), lambda t: torch.round(t * 4)),
        "where": (E.where(E.Binary("le", x, E.lift(0.25)), x * 2, E.maximum(x, 1.0) / 3 - E.minimum(x, 2.0)),
                  lambda t: torch.where(t <= 0.25, t * 2, t.clamp_min(1.0) / 3 - t.clamp_max(2.0))),
        "index": (E.where(E.Binary("eq", c % 3, E.lift(0)), (c // 3) * 1.0, E.Binary("gt", x, E.lift(0.0)) * 1.0 + r),
                  None),
    }
    if not with_erf:
        del funcs["erf"]

    def reference(t, p, d, a):
        xs = t["x"].double()
        out = {f"y_{k}": ref(xs) for k, (_, ref) in funcs.items() if ref is not None}
        cols = torch.arange(d["N"], dtype=torch.float64)[None, :].expand(d["M"], -1)
        rows = torch.arange(d["M"], dtype=torch.float64)[:, None].expand(-1, d["N"])
        out["y_index"] = torch.where(cols % 3 == 0, torch.div(cols, 3, rounding_mode="floor"), (xs > 0).double() + rows)
        return out

    op = Op(name="every_node", kclass="pointwise", doc="test op", dims=("M", "N"), row_dims=("M",),
            inputs=(TensorSpec("x", (M, N), "fp32"),),
            outputs=tuple(TensorSpec(f"y_{k}", (M, N), "fp32") for k in funcs),
            domain=(M, N),
            build=lambda a: (Let("x", E.Load("x", (r, c))),
                             *(Store(f"y_{k}", (r, c), e) for k, (e, _) in funcs.items())),
            reference=reference,
            make_inputs=lambda d, a, g: {"x": _common.randn((d["M"], d["N"]), "fp32", g, 0.0, 2.0)},
            attrs={"dtype": ("fp32",)})
    monkeypatch.setitem(OPS, "every_node", op)
    wl = workload("every_node", M=5, N=100)
    k = tvm_backend.build(wl, {"block_r": 2, "block_c": 32, "num_warps": 1}, CPU)
    assert ("T.erf(" in k.source) == with_erf
    assert ("for ci in T.serial(32)" in k.source) == with_erf
    assert ("for ci in T.vectorized(32)" in k.source) == (not with_erf)
    checks = check(wl, lambda i, o, p: k.launcher({**i, **o}, p, wl.dim), seed=2)
    assert len(checks) == len(funcs)
    for ch in checks:
        assert ch.ok, ch


def test_repeated_calls_reuse_checks_but_still_refuse_bad_tensors():
    """A kernel remembers the checks of each call signature; a new signature is checked afresh."""
    k = kernel(workload("rmsnorm", M=4, N=48, dtype="fp32"))
    w = torch.randn(48)
    for m in (3, 5, 3):
        x = torch.randn(m, 48)
        ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
        torch.testing.assert_close(k.run({"x": x, "w": w})["y"], ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(FlashgenError, match="float64"):
        k.run({"x": torch.randn(3, 48, dtype=torch.float64), "w": w})
    with pytest.raises(FlashgenError, match="contiguous last dimension"):
        k.run({"x": torch.randn(48, 3).t(), "w": w})
    with pytest.raises(FlashgenError, match="shape"):
        k.run({"x": torch.randn(3, 47), "w": w})
    with pytest.raises(FlashgenError, match="missing input 'w'"):
        k.run({"x": torch.randn(3, 48)})


def test_mixed_devices_and_bad_outputs_are_refused():
    """A tensor of another device (here torch's meta device) is a pointer the kernel does not own, even
    when the call's shapes were checked before; a given output is written in place, so its shape,
    dtype, device and layout are checked on every call."""
    k = kernel(workload("rmsnorm", M=4, N=48, dtype="fp32"))
    x, w = torch.randn(3, 48), torch.randn(48)
    k.run({"x": x, "w": w})
    with pytest.raises(FlashgenError, match=r"^rmsnorm: 'w' is on meta, 'x' on cpu; every tensor of a call"):
        k.run({"x": x, "w": torch.empty(48, device="meta")})
    for y, why in ((torch.empty(3, 47), r"output 'y' is torch.float32 \(3, 47\), expected torch.float32 \(3, 48\)"),
                   (torch.empty(3, 48, dtype=torch.float16), "output 'y' is torch.float16"),
                   (torch.empty(3, 48, device="meta"), "output 'y' is on meta, the inputs on cpu"),
                   (torch.empty(48, 3).t(), "output 'y' must be contiguous")):
        with pytest.raises(FlashgenError, match=why):
            k.run({"x": x, "w": w}, {"y": y})
    with pytest.raises(FlashgenError, match=r"outputs \['z'\] given, the op writes \['y'\]"):
        k.run({"x": x, "w": w}, {"z": torch.empty(3, 48)})
    y = torch.empty(3, 48)
    k.run({"x": x, "w": w}, {"y": y})
    torch.testing.assert_close(y, x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w, rtol=1e-5, atol=1e-5)


def test_call_signatures_remembered_are_bounded(monkeypatch):
    """Prefills bring ever new row counts: the per-kernel memory of checked signatures stays bounded."""
    from flashgen.targets import kernel as kernel_module
    monkeypatch.setattr(kernel_module, "MAX_CALL_SIGNATURES", 3)
    k = kernel(workload("rmsnorm", M=4, N=48, dtype="fp32"))
    k._calls.clear()
    w = torch.randn(48)
    for m in range(1, 9):
        x = torch.randn(m, 48)
        ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
        torch.testing.assert_close(k.run({"x": x, "w": w})["y"], ref, rtol=1e-5, atol=1e-5)
        assert len(k._calls) <= 3


# ---- the shape of the TIR, which sets the build's time: TVM's passes carry each binding in scope (and
# CompactBufferAllocation every integer one of the function) to every later statement, and FlattenBuffer
# each loop before, so kernels with many passes (a top-8 router: 24) took 8-26 s to build ----
ROUTER = workload("moe_route", M=17, E=60, topk="8", scoring="sigmoid_bias", renorm="yes", dtype="bf16")


def script(wl: Workload, schedule: dict | None = None) -> str:
    return lower.generate(wl, schedule or ScheduleSpace(wl, CPU).default()).script


def lets_outside_column_loops(src: str) -> list[str]:
    """The T.let lines of a script that are not in a loop over a row's columns (`for ci`)."""
    out, loops = [], []  # loops: the indents of the `for ci` loops around the current line
    for line in src.splitlines():
        indent = len(line) - len(line.lstrip())
        loops = [i for i in loops if i < indent]
        if line.lstrip().startswith("for ci in "):
            loops.append(indent)
        elif "T.let[" in line and not loops:
            out.append(line.strip())
    return out


@pytest.mark.parametrize("wl", [ROUTER, workload("rope", M=3, Hq=4, Hkv=2, D=64, L=50, style="gptj", dtype="bf16"),
                                workload("dequant_w4a16", N=33, K=320, G=64, zp="asym", dtype="bf16")],
                         ids=case_id)
def test_lets_bind_column_values_only_and_no_integers(wl):
    """A row's values (reductions and what they make) are slots of a local buffer, and integers in a
    column loop are written inline: the only T.let outside a column loop is a task's row index, and
    the only integer one."""
    src = script(wl)
    block_r = ScheduleSpace(wl, CPU).default()["block_r"]
    assert set(lets_outside_column_loops(src)) <= {f"r: T.let[T.int64] = rb * {block_r} + ri"}
    assert {line.strip().split(":")[0] for line in src.splitlines() if "T.let[T.int" in line} <= {"r"}
    assert "T.let" in src  # (column values are still bound)


def test_a_value_several_passes_need_is_computed_once_a_row():
    """The router's score (a sigmoid, expanded into an exp polynomial) is computed in the first pass and
    kept for the others: its code does not grow with k, whose ranks take 3 passes each."""
    routers = {k: workload("moe_route", M=17, E=60, topk=k, scoring="sigmoid_bias", renorm="yes", dtype="bf16")
               for k in ("1", "4", "8")}
    exps = {k: script(wl).count("# exp(") for k, wl in routers.items()}
    assert exps["8"] == exps["4"] == exps["1"] == 2, exps  # (once in the serial loop, once in the parallel)
    assert "kept" in script(ROUTER)
    long = workload("softmax", M=3, N=lower.KEEP_MAX_COLS + 1, dtype="bf16")  # a longer row computes again
    assert "kept" not in script(long) and "kept" in script(long.with_dims(N=lower.KEEP_MAX_COLS))


@pytest.mark.parametrize("wl", [workload("rmsnorm", M=3, N=5120, dtype="bf16"), ROUTER], ids=case_id)
def test_partial_results_fold_in_vector_statements(wl):
    """The partial results of a pass fold (and start) in statements on vectors, not in loops: the only
    loops over columns walk the row, in tiles of block_c and a ragged end."""
    block_c, cols = ScheduleSpace(wl, CPU).default()["block_c"], domain(wl)[1]
    src = script(wl)
    widths = {int(w) for w in re.findall(r"for ci in T\.vectorized\((\d+)\)", src)}
    assert widths and widths <= {block_c, cols % block_c}, widths
    assert "T.Ramp(0, 1, 2)" in src
