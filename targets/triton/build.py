"""Load generated Triton source as a module, and compile it ahead of time with no GPU present.

Triton fixes interpretation per process (TRITON_INTERPRET=1 when triton is first imported): such a
process runs kernels on CPU tensors but cannot compile them, and any other process compiles but cannot
interpret. `interpret.py` runs interpreter work in a child process for that reason.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import replace
from typing import Any

from flashgen.env import switch
from flashgen.errors import FlashgenError
from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.paths import cache_dir, writable
from flashgen.targets.descriptor import Target
from flashgen.targets.triton.emit import PDL, KernelSource
from flashgen.workload import Workload

DIVISIBILITY = 16
POINTER_ARGS = ("ptr", "scratch")  # kernel arguments passed as addresses
SCALAR_TYPE = {"stride": "i32", "dim": "i32", "param": "fp32"}  # the other runtime arguments' types


def interpreting() -> bool:
    """Whether this process's triton runs kernels in its interpreter."""
    from triton import knobs
    return bool(knobs.runtime.interpret)


def load_function(ks: KernelSource) -> Any:
    """Import the generated module (written under the cache folder, named by its hash)."""
    digest = hashlib.sha256(ks.source.encode()).hexdigest()[:20]
    mod_name = f"fg_{ks.name}_{digest}"
    path = writable(cache_dir() / "source") / f"{mod_name}.py"
    try:
        current = path.exists() and path.read_text(encoding="utf-8") == ks.source
    except (OSError, UnicodeDecodeError):
        current = False
    if not current:  # first use, or a file someone changed: what is imported is what was generated
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(ks.source, encoding="utf-8")
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return getattr(module, ks.name)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def stride_hints(ks: KernelSource, wl: Workload) -> dict[str, bool]:
    """Strides promised divisible by 16 in the binary: those of the workload's contiguous tensors that
    are, and that no row dim enters. One binary serves every row count of its workload (runtime
    dispatch), so a stride made of a row dim (a block table's width) must not be promised from the
    row count it was compiled for."""
    hints = {}
    for a in ks.args:
        if a.kind == "stride":
            inner = wl.op.tensors[a.tensor].shape[a.axis + 1:]
            varies = any(isinstance(x, E.Dim) and x.name in wl.op.row_dims for e in inner for x in E.walk(e))
            hints[a.name] = not varies and contiguous_strides(wl.shape(a.tensor))[a.axis] % DIVISIBILITY == 0
    return hints


def ast_source(ks: KernelSource, wl: Workload):
    """Triton's description of what to compile: signature, baked constants, alignment promises (a
    Gluon kernel's the same, in Gluon's source class, which `triton.compile` lowers from its layouts)."""
    import triton

    fn = load_function(ks)
    hints = stride_hints(ks, wl)
    signature, constexprs, attrs = {}, {}, {}
    for i, a in enumerate(ks.args):
        if a.kind in POINTER_ARGS:
            dt = wl.tensor_dtype(a.tensor) if a.kind == "ptr" else next(sc.dtype for sc in ks.scratch if sc.name == a.tensor)
            signature[a.name] = "*" + dtypes.TRITON[dt]
            attrs[(i,)] = [["tt.divisibility", DIVISIBILITY]]
        elif a.kind in SCALAR_TYPE:
            signature[a.name] = SCALAR_TYPE[a.kind]
            if hints.get(a.name):
                attrs[(i,)] = [["tt.divisibility", DIVISIBILITY]]
        else:
            signature[a.name] = "constexpr"
            constexprs[a.name] = a.value
    if ks.dialect == "gluon":
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def for_target(ks: KernelSource, target: Target) -> KernelSource:
    """The generated kernel with its build constants for `target`: programmatic dependent launch on
    where the GPU has it (NVIDIA sm_90 and newer), so that in a stream or CUDA graph each kernel is
    resident before the previous one ends. FLASHGEN_PDL=0 builds without it (to measure what it brings)."""
    pdl = int(target.pdl and switch("FLASHGEN_PDL"))
    return replace(ks, args=[replace(a, value=pdl) if a.kind == "constexpr" and a.name == PDL else a for a in ks.args])


def compile_aot(ks: KernelSource, wl: Workload, schedule: dict, target: Target):
    """Compile for the target's GPU with Triton alone (no driver needed); returns a CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget

    if interpreting():
        raise FlashgenError("ahead-of-time compilation needs a process started without TRITON_INTERPRET=1")
    backend, arch = target.triton_target
    return triton.compile(ast_source(ks, wl), target=GPUTarget(backend, arch, target.warp_size),
                          options=compile_options(ks, schedule))


def compile_options(ks: KernelSource, schedule: dict) -> dict[str, Any]:
    """Triton's compile options for this kernel: warps, pipeline stages, programmatic dependent launch."""
    options: dict[str, Any] = {"num_warps": schedule["num_warps"], "num_stages": schedule.get("num_stages", 1)}
    if uses_pdl(ks):
        options["launch_pdl"] = True
    return options


def uses_pdl(ks: KernelSource) -> bool:
    """Whether the kernel was built with programmatic dependent launch (`for_target`)."""
    return any(a.kind == "constexpr" and a.name == PDL and a.value for a in ks.args)


def load_compiled(src: Any, files: dict[str, str], triton_hash: str):
    """A CompiledKernel from files kept on disk: launchable without compiling again."""
    from triton.compiler.compiler import CompiledKernel

    return CompiledKernel(src, files, triton_hash)


