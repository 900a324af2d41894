"""The kernel-class registry: every class provides each part, and the layers reach a class only through it.

The toy class below is registered the way docs/adding-a-kernel-class.md describes (this module serves
as its space rules, its features module and its Triton generator); ScheduleSpace, the features, the
Triton codegen and the compiler's support check then serve it without knowing its name, and the CPU
target, whose TVM backend has no generator for it, refuses it in one line.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashgen import oplib
from flashgen.compiler import check_supported
from flashgen.errors import FlashgenError
from flashgen.ir.expr import Load
from flashgen.ir.op import DTYPE, Op, Reduce, Store, TensorSpec
from flashgen.kernel_classes import CLASSES, KernelClass, kernel_class, supported
from flashgen.oplib._common import M, N, c, f64, r, randn
from flashgen.schedules.features import analytic_latency_us, feature_matrix, feature_names
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import Target, device_target, get_target
from flashgen.workload import Schedule, Workload, workload

H200, CPU = get_target("h200"), get_target("cpu")

# -- the toy class's space rules: `block` columns per program, `unroll` added after records existed
ADDED = {"unroll": 1}


def knobs(wl: Workload, target: Target) -> dict[str, tuple[int, ...]]:
    return {"block": (16, 32, 64), "unroll": (1, 2)}


def added_knobs(wl: Workload) -> dict[str, int]:
    return ADDED


def why_invalid(wl: Workload, target: Target, s: Schedule) -> str | None:
    return "an unrolled block must divide N" if s["unroll"] > 1 and wl.dim["N"] % s["block"] else None


def default(wl: Workload, target: Target) -> Schedule:
    return {"block": 32, "unroll": 2}


# -- its features
FEATURE_NAMES = ("block", "log2_block")


def columns(wl: Workload, schedules: list[Schedule], target: Target) -> dict[str, np.ndarray]:
    block = np.asarray([float(s["block"]) for s in schedules])
    return {"block": block, "log2_block": np.log2(block), "_latency_us": wl.dim["N"] / block}


# -- its Triton generator
def generate_toy(wl: Workload, schedule: Schedule) -> tuple[str, Schedule]:
    return (wl.op_name, dict(schedule))


def _toy_op(kclass: str, reduce: bool = False) -> Op:
    body = (Reduce("s", "sum", Load("x", (r, c))),) if reduce else ()
    return Op(name=f"{kclass}_copy", kclass=kclass, doc="y = x", dims=("M", "N"), row_dims=("M",),
              inputs=(TensorSpec("x", (M, N), DTYPE),), outputs=(TensorSpec("y", (M, N), DTYPE),),
              domain=(M, N), build=lambda a: (*body, Store("y", (r, c), Load("x", (r, c)))),
              reference=lambda t, p, d, a: {"y": f64(t["x"])},
              make_inputs=lambda d, a, g: {"x": randn((d["M"], d["N"]), a["dtype"], g)})


@pytest.fixture
def toy(monkeypatch) -> Op:
    """The toy class registered (one registry line) and one op of it in the op library."""
    monkeypatch.setitem(CLASSES, "toy", KernelClass("toy", __name__, __name__, {"triton": f"{__name__}:generate_toy"}))
    op = _toy_op("toy")
    monkeypatch.setitem(oplib.OPS, op.name, op)
    return op



@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_class_provides_each_part(name):
    k = kernel_class(name)
    rules, feats = k.space_rules(), k.feature_module()
    parts = ("variants", "current", "flat_of", "implied") if hasattr(rules, "variants") else ("knobs",)
    assert all(callable(getattr(rules, f)) for f in (*parts, "added_knobs", "why_invalid", "default"))
    assert len(set(feats.FEATURE_NAMES)) == len(feats.FEATURE_NAMES) > 0 and callable(feats.columns)
    assert k.generators and all(callable(k.generator(b)) for b in k.generators)


def test_backends_support_exactly_the_classes_with_their_generator():
    assert supported("triton") == ["rowwise", "pointwise", "contraction", "attention", "moe"]
    assert supported("tvm") == ["rowwise", "pointwise"]
    with pytest.raises(FlashgenError, match="unknown kernel class 'ssm'"):
        kernel_class("ssm")


def test_space_reaches_the_class_through_the_registry(toy):
    wl = workload(toy.name, M=3, N=100, dtype="fp16")
    space = ScheduleSpace(wl, H200)
    assert space.knobs() == knobs(wl, H200)
    assert space.complete({"block": 16}) == {"block": 16, "unroll": 1}
    assert space.is_valid({"block": 16}) and not space.is_valid({"block": 32, "unroll": 2})
    assert sorted((s["block"], s["unroll"]) for s in space) == [(16, 1), (32, 1), (64, 1)]
    with pytest.raises(FlashgenError) as e:
        space.default()   # {block 32, unroll 2} does not divide N=100
    assert "toy default" in str(e.value) and "must divide N" in str(e.value) and "\n" not in str(e.value)
    wl = workload(toy.name, M=3, N=96, dtype="fp16")
    assert ScheduleSpace(wl, H200).default() == {"block": 32, "unroll": 2}
    assert ScheduleSpace(wl, H200, fixed=(("unroll", 1),)).pinned_default() == {"block": 32, "unroll": 1}
    assert ScheduleSpace(wl, H200, fixed=(("block", 64),)).pinned_default() is None


def test_features_and_codegen_reach_the_class_through_the_registry(toy):
    from flashgen.targets.triton.codegen import generate

    wl = workload(toy.name, M=5, N=96, dtype="bf16")
    schedules = [{"block": 16, "unroll": 1}, {"block": 64, "unroll": 1}]
    assert feature_names("toy") == FEATURE_NAMES
    m = feature_matrix(wl, schedules, H200)
    assert m.shape == (2, 2) and m.dtype == np.float32 and m[:, 0].tolist() == [16.0, 64.0]
    assert analytic_latency_us(wl, schedules, H200).tolist() == [96 / 16, 96 / 64]
    assert generate(wl, schedules[1]) == (toy.name, schedules[1])


def test_a_backend_without_the_class_generator_refuses_it_in_one_line(toy):
    tvm_backend = pytest.importorskip("flashgen.targets.tvm_backend")
    wl = workload(toy.name, M=2, N=64, dtype="fp32")
    check_supported(wl, H200)
    with pytest.raises(FlashgenError) as e:
        check_supported(wl, CPU)
    assert str(e.value) == "toy kernels are not generated for cpu/host yet (its tvm backend generates rowwise, pointwise)"
    with pytest.raises(FlashgenError, match="not generated by the tvm backend"):
        tvm_backend.build(wl, {"block": 16, "unroll": 1}, CPU)


def test_a_class_that_does_not_reduce_refuses_reductions(monkeypatch):
    monkeypatch.setitem(CLASSES, "toy", KernelClass("toy", __name__, __name__, reduces=False))
    assert _toy_op("toy").body({"dtype": "fp32"})
    with pytest.raises(ValueError, match="a toy op cannot reduce"):
        _toy_op("toy", reduce=True).body({"dtype": "fp32"})
    with pytest.raises(ValueError, match="a pointwise op cannot reduce"):
        _toy_op("pointwise", reduce=True).body({"dtype": "fp32"})
    assert _toy_op("rowwise", reduce=True).body({"dtype": "fp32"})


def test_device_target_of_the_cpu():
    assert device_target(torch.device("cpu")).id == device_target("cpu").id == CPU.id
    if not torch.cuda.is_available():
        assert device_target().id == CPU.id


def _runtime_imports(tree) -> list[str]:
    """The flashgen modules a file imports when it runs (imports under `if TYPE_CHECKING:` are types only)."""
    import ast
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        else:
            out += _runtime_imports(node)
    return out


def test_imports_run_one_way():
    """ir -> workload -> descriptor -> spaces -> backends -> compiler -> tuner / runtime: no module imports
    one of a layer above it (a backend reaches a class's rules through the registry)."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    above = {"flashgen/ir": ("workload", "targets", "schedules", "compiler", "runtime", "db"),
             "flashgen/oplib": ("targets", "schedules", "compiler", "runtime", "db"),
             "targets": ("schedules", "compiler", "runtime"), "schedules": ("runtime",)}
    # the tuner's timing replays kernels from CUDA graphs as the runtime captures them: runtime/serving/graphs.py,
    # which imports no flashgen module, is the one runtime module below the tuner
    shared = "flashgen.runtime.serving.graphs"
    for folder, names in above.items():
        for path in (root / folder).rglob("*.py"):
            for module in _runtime_imports(ast.parse(path.read_text())):
                parts = module.split(".")
                assert module == shared or not (parts[0] == "flashgen" and len(parts) > 1 and parts[1] in names), \
                    f"{path.relative_to(root)} imports {module}, a layer above it"
    assert not [m for m in _runtime_imports(ast.parse((root / "runtime/serving/graphs.py").read_text()))
                if m.startswith("flashgen")]
    for path in (root / "runtime/serving").rglob("*.py"):  # the wing the decoder and checkpoints build on
        assert not [m for m in _runtime_imports(ast.parse(path.read_text()))
                    if m.startswith(("flashgen.runtime.decoder", "flashgen.runtime.checkpoints"))], path
