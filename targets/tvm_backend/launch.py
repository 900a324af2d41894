"""Calling a compiled TVM CPU kernel on torch tensors, and timing it.

Tensors cross into TVM through DLPack without copies (torch CPU tensors are accepted by TVM's FFI as
they are); bf16 tensors are passed as their uint16 bits, as the kernel declares them. The kernel
reads M (every row dim) off the tensors' shapes, checks every other dim, dtype and stride itself and
raises on a mismatch. A non-contiguous input is copied to a contiguous one; a non-contiguous output is
computed into a contiguous buffer and copied back.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from flashgen.errors import FlashgenError
from flashgen.ir.op import eval_int
from flashgen.targets.tvm_backend.lower import TVMArg
from flashgen.workload import Workload


class TVMLauncher:
    """Holds the loaded library and the argument recipe; a launch only gathers arguments.

    `launcher(tensors, params, dims)` runs the kernel once. `launcher.time(...)` measures it with TVM's
    time_evaluator (one untimed warm-up call, then `repeat` rounds of `number` calls) and returns the
    seconds per call of each round: a list of `repeat` floats, each the mean over its `number` calls.
    """

    def __init__(self, wl: Workload, args: list[TVMArg], lib: Any, entry: str):
        self.wl, self.args, self.lib, self.entry = wl, args, lib, entry
        self.fn = lib[entry]

    def _gather(self, tensors: Mapping[str, torch.Tensor], params: Mapping[str, float],
                dims: Mapping[str, int]) -> tuple[list[Any], list[tuple[torch.Tensor, torch.Tensor]]]:
        out: list[Any] = []
        copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        outputs = {t.name for t in self.wl.outputs} | {t.name for t in self.wl.inputs if t.written}
        for a in self.args:
            if a.kind == "tensor":
                t = tensors[a.tensor]
                if t.device.type != "cpu":
                    raise FlashgenError(f"{self.wl.op_name}: a cpu kernel takes CPU tensors, "
                                        f"'{a.tensor}' is on {t.device}")
                if not t.is_contiguous():
                    c = t.contiguous()
                    if a.tensor in outputs:
                        copy_back.append((t, c))
                    t = c
                out.append(t.view(torch.uint16) if t.dtype == torch.bfloat16 else t)
            elif a.kind == "dim":
                out.append(int(dims[a.name]))
            else:
                out.append(float(params[a.name]))
        return out, copy_back

    def rows(self, dims: Mapping[str, int]) -> int:
        return eval_int(self.wl.op.domain[0], dims)

    def __call__(self, tensors: Mapping[str, torch.Tensor], params: Mapping[str, float],
                 dims: Mapping[str, int]) -> None:
        if self.rows(dims) == 0:
            return
        args, copy_back = self._gather(tensors, params, dims)
        self.fn(*args)
        for dst, src in copy_back:
            dst.copy_(src)

    def time(self, tensors: Mapping[str, torch.Tensor], params: Mapping[str, float],
             dims: Mapping[str, int], number: int = 10, repeat: int = 3, min_repeat_ms: int = 0,
             flush_bytes: int = 0) -> list[float]:
        """Seconds per call, one value per round (see the class doc). `min_repeat_ms` raises `number`
        until a round lasts that long; `flush_bytes` > 0 evicts that many bytes of cache before each
        round (memory-bound kernels measured cold)."""
        import tvm

        args, _ = self._gather(tensors, params, dims)
        # the library may have been loaded before tvm was imported (runtime.py): a plain tvm_ffi Module,
        # which lacks tvm's method but is what the method takes
        timer = tvm.runtime.Module.time_evaluator(self.lib, self.entry, tvm.cpu(), number=number, repeat=repeat,
                                                  min_repeat_ms=min_repeat_ms, cache_flush_bytes=flush_bytes)
        return [float(x) for x in timer(*args).results]
