"""The native launch path: its C module builds without a GPU and refuses bad values, it applies to
the kernels it can launch (and leaves the rest to Triton's launcher), and its value kinds follow the
signature the binary was compiled with."""
from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

import flashgen
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target
from flashgen.targets.triton.build import ast_source
from flashgen.targets.triton.codegen import generate
from flashgen.targets.triton.native_launch import KIND, MAX_VALUES, module, native_launch


def _has_driver() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def test_module_builds_and_refuses_bad_values():
    launch = module().launch
    static = (0, 128, 0, 0, b"pif", 0)
    with pytest.raises(TypeError, match="2 values given, the kernel takes 3"):
        launch(static, 1, 1, 1, 0, 16, 3)
    with pytest.raises(OverflowError, match="32-bit int"):
        launch(static, 1, 1, 1, 0, 16, 2 ** 31, 1.0)
    with pytest.raises(ValueError, match="unknown value kind"):
        launch((0, 128, 0, 0, b"px", 0), 1, 1, 1, 0, 16, 3)
    with pytest.raises(TypeError, match="6-tuple"):
        launch((0, 128), 1, 1, 1, 0)
    launch(static, 0, 1, 1, 0, 16, 3, 1.0)  # an empty grid launches nothing (as Triton's launcher does)
    if not _has_driver():
        with pytest.raises(RuntimeError, match="libcuda.so.1"):
            launch(static, 1, 1, 1, 0, 16, 3, 1.0)


def _compiled(**metadata) -> SimpleNamespace:
    md = {"backend_name": "cuda", "global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1,
          "launch_cooperative_grid": False, "num_warps": 4, "shared": 1024, "launch_pdl": True, **metadata}
    return SimpleNamespace(metadata=SimpleNamespace(**md), function=1234, _init_handles=lambda: None)


def test_native_launch_applies_only_where_it_can(monkeypatch):
    native = native_launch(_compiled(), "ppif", 0)
    assert native is not None and native.static == (1234, 128, 1024, 1, b"ppif", 0)
    for md in ({"backend_name": "hip"}, {"global_scratch_size": 128}, {"profile_scratch_size": 64},
               {"num_ctas": 2}, {"launch_cooperative_grid": True}):
        assert native_launch(_compiled(**md), "ppif", 0) is None, md
    assert native_launch(_compiled(), "p" * (MAX_VALUES + 1), 0) is None
    monkeypatch.setenv("FLASHGEN_NATIVE_LAUNCH", "0")
    assert native_launch(_compiled(), "ppif", 0) is None


@pytest.mark.parametrize("op, dims, attrs", [
    ("rmsnorm", {"M": 3, "N": 1000}, {"dtype": "bf16"}),
    ("gemm_w4a16", {"M": 17, "N": 330, "K": 1024}, {"dtype": "bf16", "G": 128}),
    ("gemm", {"M": 256, "N": 330, "K": 2048}, {"dtype": "fp16", "with_bias": "yes"}),
    ("paged_decode_attention", {"B": 3, "Hq": 8, "Hkv": 2, "D": 128, "BS": 16, "NB": 64, "MAXB": 8, "L": 100},
     {"dtype": "bf16"}),
])
def test_value_kinds_follow_the_compiled_signature(op, dims, attrs):
    """One value per non-constexpr parameter, of the type the binary was compiled for."""
    wl = flashgen.workload(op, **dims, **attrs)
    s = ScheduleSpace(wl, get_target("h200")).default()
    if op == "gemm":
        s = {**s, "split_k": 2}  # with its scratch buffers
    ks = generate(wl, s)
    sig = [t for t in ast_source(ks, wl).signature.values() if t != "constexpr"]
    kinds = "".join(KIND[a.kind] for a in ks.args if a.kind in KIND)
    assert kinds == "".join("p" if t.startswith("*") else {"i32": "i", "fp32": "f"}[t] for t in sig)


def test_bound_call_relaunches_on_its_tensors():
    """`Kernel.bind` checks once; each call runs the kernel again on the same (changed) inputs."""
    wl = flashgen.workload("rmsnorm", M=5, N=48, dtype="fp32")
    k = flashgen.compile(wl, get_target("cpu"))
    x, w = torch.randn(5, 48), torch.randn(48)
    bound = k.bind({"x": x, "w": w})
    for _ in range(2):
        x.copy_(torch.randn(5, 48))
        bound()
        ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
        torch.testing.assert_close(bound.outputs["y"], ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(flashgen.FlashgenError, match="shape"):
        k.bind({"x": torch.randn(5, 47), "w": w})


def test_native_values_are_the_arguments_without_constexprs():
    """The values the native launch takes are the launcher's arguments with tensors as their
    addresses and constexprs left out (a split-K GEMM: pointers, scratch, strides, dims)."""
    from flashgen.targets.kernel import bind_dims
    from flashgen.targets.triton.launch import TritonLauncher

    wl = flashgen.workload("gemm", M=17, N=330, K=2048, dtype="fp16", with_bias="yes")
    s = {**ScheduleSpace(wl, get_target("h200")).default(), "split_k": 2}
    launcher = TritonLauncher(generate(wl, s), wl, get_target("h200"))
    tensors = dict(wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(0)))
    tensors["y"] = torch.empty(17, 330, dtype=torch.float16)
    dims = bind_dims(wl, tensors)
    full = launcher.args(tensors, wl.op.params, dims)
    values = launcher.args(tensors, wl.op.params, dims, native=True)
    kept = [(a, v) for a, v in zip(launcher.ks.args, full) if a.kind != "constexpr"]
    assert len(values) == len(kept) and any(a.kind == "scratch" for a, _ in kept)
    for (a, v), got in zip(kept, values):
        assert got == (v.data_ptr() if isinstance(v, torch.Tensor) else v), a


def test_a_binary_serves_the_gpu_it_was_loaded_on():
    """Tensors on another GPU than the one a kernel's binary was loaded on: a clear error, not a
    launch of a function handle that GPU does not know."""
    from flashgen.targets.triton.launch import TritonLauncher

    wl = flashgen.workload("rmsnorm", M=3, N=1000, dtype="bf16")
    launcher = TritonLauncher(generate(wl, ScheduleSpace(wl, get_target("h200")).default()), wl, get_target("h200"))
    launcher._device = 0
    assert launcher._check_device(torch.device("cuda", 0)) == 0
    with pytest.raises(flashgen.FlashgenError, match="loaded on cuda:0; compile the workload again for tensors on cuda:1"):
        launcher._check_device(torch.device("cuda", 1))
