"""Parse generated TVMScript, compile it with LLVM for this CPU, and collect the artifacts.

The LLVM target is the build machine's CPU (`-mcpu` from LLVM's host detection, so AVX2/AVX-512 are
used where present); $FLASHGEN_LLVM_MCPU overrides it (e.g. "x86-64-v3" for a binary that must run on
other x86 machines). The shared library comes from `export_library`, which links with the system C
compiler (gcc or cc).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import tvm
from tvm.target import codegen

from flashgen.errors import FlashgenError
from flashgen.targets.tvm_backend.lower import KernelSource


def llvm_target() -> tvm.target.Target:
    mcpu = os.environ.get("FLASHGEN_LLVM_MCPU") or codegen.llvm_get_system_cpu()
    spec: dict[str, Any] = {"kind": "llvm"}
    if mcpu and mcpu != "generic":
        spec["mcpu"] = mcpu
    return tvm.target.Target(spec)


def parse(ks: KernelSource) -> tvm.tirx.PrimFunc:
    try:
        return tvm.script.parse(ks.script)
    except Exception as e:  # the parser reports the line; keep it one readable error
        raise FlashgenError(f"TVM rejected the generated source of {ks.name}: {e}") from None


def compile_module(ks: KernelSource, target: tvm.target.Target | None = None) -> Any:
    """TVMScript text -> an executable module (tvm.runtime.Executable) for the CPU."""
    func = parse(ks)
    return tvm.compile(tvm.IRModule({ks.name: func}), target=target or llvm_target())


def artifacts(ex: Any) -> dict[str, str]:
    """LLVM IR and host assembly texts of a compiled module."""
    asm = {"llvm": ex.mod.inspect_source("ll")}
    try:
        asm["s"] = ex.mod.inspect_source("s")
    except Exception:  # not every LLVM build can print assembly; the IR is enough
        pass
    return asm


def export(ex: Any, name: str) -> tuple[bytes, Any]:
    """Link the module into a shared library; returns its bytes and the library loaded back.

    The launcher runs the loaded library, so what is saved is exactly what ran in the checks.
    """
    with tempfile.TemporaryDirectory(prefix="flashgen-tvm-") as tmp:
        path = Path(tmp) / f"{name}.so"
        try:
            ex.export_library(str(path))
        except Exception as e:
            raise FlashgenError(f"linking {name}.so failed (is a C compiler installed?): {e}") from None
        data = path.read_bytes()
        lib = tvm.runtime.load_module(str(path))  # stays mapped after the file is gone
    return data, lib


def load_library(data: bytes, name: str) -> Any:
    """Load a shared library from its bytes (a saved Kernel's .so)."""
    with tempfile.TemporaryDirectory(prefix="flashgen-tvm-") as tmp:
        path = Path(tmp) / f"{name}.so"
        path.write_bytes(data)
        return tvm.runtime.load_module(str(path))
