"""flashgen: generated kernels for LLM inference operators, tuned per GPU and shape.

    import flashgen
    wl = flashgen.workload("rmsnorm", M=4096, N=8192, dtype="bf16")
    kernel = flashgen.compile(wl, target="h200")   # AOT: works without a GPU
    kernel.source, kernel.asm["ptx"], kernel.binary, kernel.metadata
"""
from __future__ import annotations

__version__ = "0.1.0"

from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.lazy import exports  # noqa: E402
from flashgen.oplib import OPS, get_op  # noqa: E402
from flashgen.workload import Workload, workload  # noqa: E402  (the function, not its module, is flashgen.workload)

# The compiler and `patch` are imported at their first use: `flashgen --help` and `ops` load neither (nor torch).
__getattr__ = exports("flashgen", {"compile": "flashgen.compiler", "patch": "flashgen.runtime.patch"})
__all__ = ["__version__", "compile", "patch", "FlashgenError", "OPS", "get_op", "Workload", "workload"]
