"""TVM's runtime without the `tvm` package: what loading and running a CPU kernel already built needs.

`import tvm` costs about 3 s of Python modules (its IR, TVMScript, Relax, TE) that only compiling uses;
a process whose kernels all come from the artifact cache (a second `flashgen generate`) needs TVM's
shared libraries and tvm_ffi alone. They are loaded here as tvm/base.py loads them (TVM's own search
path, the same load modes), so a later `import tvm` for a build finds them loaded and shares them;
where that fails (a layout of TVM other than this one), `import tvm` loads them instead.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def _load(name: str, mode: str) -> None:
    """TVM's library `name` (libtvm_<name>.so), loaded as tvm/base.py loads it."""
    if "tvm.base" in sys.modules:  # the tvm package loaded its libraries itself
        return
    try:
        from tvm_ffi.libinfo import load_lib_ctypes

        # tvm/libinfo.py imports nothing of tvm: run it on its own for TVM's library search path
        spec = importlib.util.find_spec("tvm")
        where = Path(spec.submodule_search_locations[0]) / "libinfo.py"
        info_spec = importlib.util.spec_from_file_location("_flashgen_tvm_libinfo", where)
        info = importlib.util.module_from_spec(info_spec)
        info_spec.loader.exec_module(info)
        load_lib_ctypes("tvm", name, mode, extra_lib_paths=info.package_lib_paths())
    except Exception:  # noqa: BLE001 (any failure: let TVM find its libraries)
        import tvm  # noqa: F401


@functools.cache
def _runtime() -> None:
    _load("tvm_runtime", "RTLD_GLOBAL")  # the kernels' thread pool and backend calls


@functools.cache
def tvm_version() -> str:
    """The installed TVM's version, read from its package metadata (tvm.__version__ of a wheel)."""
    try:
        return importlib.metadata.version("apache-tvm")
    except importlib.metadata.PackageNotFoundError:  # a source build: ask the package
        import tvm

        return tvm.__version__


@functools.cache
def host_cpu() -> str:
    """LLVM's name of this CPU (`-mcpu`), as TVM's host detection gives it."""
    import tvm_ffi

    _runtime()
    _load("tvm_compiler", "RTLD_LOCAL")  # LLVM: mapped, not initialised, in 30 ms
    return str(tvm_ffi.get_global_func("target.llvm_get_system_cpu")())


def llvm_spec() -> dict[str, str]:
    """The LLVM target a build compiles for, in TVM's dict form: this CPU's `mcpu`, or
    $FLASHGEN_LLVM_MCPU's (llvm.py)."""
    mcpu = os.environ.get("FLASHGEN_LLVM_MCPU") or host_cpu()
    return {"kind": "llvm", "mcpu": mcpu} if mcpu and mcpu != "generic" else {"kind": "llvm"}


def load_library(data: bytes, name: str) -> Any:
    """Load a kernel's shared library from its bytes, from a fresh path each time (the dynamic loader
    would hand back an earlier library loaded from the same path)."""
    import tvm_ffi

    _runtime()
    with tempfile.TemporaryDirectory(prefix="flashgen-tvm-") as tmp:
        path = Path(tmp) / f"{name}.so"
        path.write_bytes(data)
        return tvm_ffi.load_module(os.fspath(path))  # stays mapped after the file is gone
