"""Parse generated TVMScript, compile it with LLVM for this CPU, and collect the artifacts.

The LLVM target is the build machine's CPU (`-mcpu` from LLVM's host detection, so AVX2/AVX-512 are
used where present); $FLASHGEN_LLVM_MCPU overrides it (e.g. "x86-64-v3" for a binary that must run on
other x86 machines). The shared library comes from `export_library`, which links with the system C
compiler (gcc or cc). Importing this module imports tvm (seconds): only a build does.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import tvm

from flashgen.errors import FlashgenError
from flashgen.targets.tvm_backend.lower import TVMSource
from flashgen.targets.tvm_backend.runtime import llvm_spec


def llvm_target(spec: dict[str, str] | None = None) -> tvm.target.Target:
    """TVM's target for `spec` (`llvm_spec()`, the build machine's by default)."""
    return tvm.target.Target(spec or llvm_spec())


def parse(ks: TVMSource) -> tvm.tirx.PrimFunc:
    try:
        return tvm.script.parse(ks.script)
    except Exception as e:  # the parser reports the line; keep it one readable error
        raise FlashgenError(f"TVM rejected the generated source of {ks.name}: {e}") from None


def compile_module(ks: TVMSource, target: tvm.target.Target | None = None) -> Any:
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


def export(ex: Any, name: str) -> bytes:
    """Link the module into a shared library; returns its bytes."""
    with tempfile.TemporaryDirectory(prefix="flashgen-tvm-") as tmp:
        path = Path(tmp) / f"{name}.so"
        try:
            ex.export_library(str(path))
        except Exception as e:
            raise FlashgenError(f"linking {name}.so failed (is a C compiler installed?): {e}") from None
        return path.read_bytes()
