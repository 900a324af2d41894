"""Dtype names shared by the IR, workloads, targets and backends.

One short name per dtype; each backend maps it to its own spelling here, so no other module has to.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FLOAT = ("fp32", "fp16", "bf16")
FP8 = ("fp8e4m3",)
INT = ("int8", "int32", "int64")



class _TorchDtypes(Mapping):
    """name -> torch dtype, importing torch at the first lookup (the names are known without it)."""

    _ATTRS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8e4m3": "float8_e4m3fn",
              "int8": "int8", "int32": "int32", "int64": "int64"}

    def __getitem__(self, name: str) -> "torch.dtype":
        import torch
        return getattr(torch, self._ATTRS[name])

    def __contains__(self, name: object) -> bool:
        return name in self._ATTRS

    def __iter__(self) -> Iterator[str]:
        return iter(self._ATTRS)

    def __len__(self) -> int:
        return len(self._ATTRS)


TORCH = _TorchDtypes()
# Triton pointer element types (signature strings) and `tl.` dtype names.
TRITON = {
    "fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "fp8e4m3": "fp8e4nv",
    "int8": "i8", "int32": "i32", "int64": "i64",
}
TL = {
    "fp32": "tl.float32", "fp16": "tl.float16", "bf16": "tl.bfloat16", "fp8e4m3": "tl.float8e4nv",
    "int8": "tl.int8", "int32": "tl.int32", "int64": "tl.int64",
}
TVM = {
    "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int8": "int8", "int32": "int32",
    "int64": "int64",
}
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8e4m3": 1, "int8": 1, "int32": 4, "int64": 8}
# Largest finite magnitude of the quantized output types (the scale maps a row's absmax onto it).
QMAX = {"int8": 127.0, "fp8e4m3": 448.0}


def is_float(dtype: str) -> bool:
    return dtype in FLOAT or dtype in FP8


def of_torch(dt: torch.dtype) -> str:
    for name, t in TORCH.items():
        if t == dt:
            return name
    raise KeyError(f"no flashgen dtype for {dt}")
