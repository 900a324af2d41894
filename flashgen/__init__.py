"""flashgen: generated kernels for LLM inference operators, tuned per GPU and shape.

    import flashgen
    wl = flashgen.workload("rmsnorm", M=4096, N=8192, dtype="bf16")
    kernel = flashgen.compile(wl, target="h200")   # AOT: works without a GPU
    kernel.source, kernel.asm["ptx"], kernel.binary, kernel.metadata
"""
__version__ = "0.1.0"

from flashgen.compiler import compile  # noqa: E402
from flashgen.errors import FlashgenError  # noqa: E402
from flashgen.oplib import OPS, get_op  # noqa: E402
from flashgen.workload import Workload, workload  # noqa: E402

__all__ = ["__version__", "compile", "FlashgenError", "OPS", "get_op", "Workload", "workload"]
