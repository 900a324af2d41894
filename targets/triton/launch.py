"""Launching generated Triton kernels: the AOT binary on a matching GPU, the interpreter on CPU tensors
(in a process started with TRITON_INTERPRET=1)."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping

import torch
import triton
from triton.runtime import _allocation

from flashgen.errors import FlashgenError
from flashgen.ir.op import eval_int
from flashgen.targets.buffers import kept_buffer
from flashgen.targets.descriptor import Target
from flashgen.targets.device import device_arch
from flashgen.targets.triton.build import DIVISIBILITY, interpreting, load_function, stride_hints, uses_pdl
from flashgen.targets.triton.codegen import grid
from flashgen.targets.triton.emit import KernelSource
from flashgen.targets.triton.native_launch import KIND, NativeLaunch, native_launch
from flashgen.workload import Workload

MAX_PLANS = 4096  # grids remembered per launcher, by the call's dims (row counts of prefills vary without end)
_UNSET = object()
_PTR, _STRIDE, _DIM, _PARAM, _SCRATCH, _CONST = range(6)
_CODE = {"ptr": _PTR, "stride": _STRIDE, "dim": _DIM, "param": _PARAM, "scratch": _SCRATCH, "constexpr": _CONST}


def _scratch_allocator(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for a launch, from torch's caching allocator (inside a CUDA graph capture, from
    the graph's pool): kernels that build TMA descriptors on the device write them there."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """Triton asks a per-context allocator for such scratch at launch; give it one if none is set."""
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch_allocator)


class TritonLauncher:
    """Holds the compiled kernel and the argument recipe; a launch only gathers arguments. On NVIDIA
    GPUs it launches through `native_launch` (Triton's launcher where that does not apply)."""

    def __init__(self, ks: KernelSource, wl: Workload, target: Target, compiled: Any = None):
        self.ks, self.wl, self.target, self.compiled = ks, wl, target, compiled
        self.hints = stride_hints(ks, wl)
        # per argument: (kind code, name, tensor, axis, stride promised divisible, constexpr value)
        self._recipe = tuple((_CODE[a.kind], a.name, a.tensor, a.axis, bool(self.hints.get(a.name)), a.value)
                             for a in ks.args)
        self._values = tuple(r for r in self._recipe if r[0] != _CONST)  # what the native launch takes
        self._interpreted = None
        self._device: int | None = None  # the GPU the binary is loaded on, its architecture checked
        self._scratch: dict[tuple[str, str], torch.Tensor] = {}  # (scratch name, device) -> buffer
        self._outgrown: list[torch.Tensor] = []  # kept alive: CUDA graphs captured earlier still use them
        # TMA descriptors built on the device live in global scratch that Triton's launcher allocates
        self._global_scratch = bool(getattr(getattr(compiled, "metadata", None), "global_scratch_size", 0))
        self._plans: dict[tuple[int, ...], tuple[int, tuple[int, int, int]]] = {}  # dims -> (rows, grid)
        self._native: NativeLaunch | None | object = _UNSET

    def scratch(self, name: str, dims: Mapping[str, int], device: torch.device) -> torch.Tensor:
        """The kernel's scratch buffer on `device`, at least as large as these dims need. A buffer too
        small is replaced by one twice as large (at least), so few outgrown buffers are kept."""
        from flashgen.ir import dtypes

        sc = next(x for x in self.ks.scratch if x.name == name)
        n = max(1, sc.elements(dims))
        key = (name, str(device))
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < n:
            if buf is not None:
                self._outgrown.append(buf)
                n = max(n, 2 * buf.numel())
            buf = self._scratch[key] = kept_buffer(n, dtypes.TORCH[sc.dtype], device, sc.zeroed)
        return buf

    def args(self, tensors: Mapping[str, torch.Tensor], params: Mapping[str, float],
             dims: Mapping[str, int], native: bool = False) -> list[Any]:
        """The kernel's arguments in order; `native`: the values `native_launch` takes (addresses as
        integers, no constexprs). The recipe is worked out once (`_recipe`): calls are hot."""
        out: list[Any] = []
        strides: dict[str, tuple[int, ...]] = {}  # read once per tensor: one call costs less than one per axis
        for kind, name, tensor, axis, hinted, value in (self._values if native else self._recipe):
            if kind == _PTR:
                t = tensors[tensor]
                address = t.data_ptr()
                if address % DIVISIBILITY:
                    raise FlashgenError(f"{self.wl.op_name}: tensor '{tensor}' starts at an address that is not a "
                                        f"multiple of {DIVISIBILITY} bytes, as this binary assumes (a view at an "
                                        "odd offset?); pass a copy")
                out.append(address if native else t)
            elif kind == _STRIDE:
                st = strides.get(tensor)
                if st is None:
                    st = strides[tensor] = tensors[tensor].stride()
                v = st[axis]
                if hinted and v % DIVISIBILITY and tensors[tensor].shape[axis] == 1:
                    v = 0  # a size-1 axis is only ever indexed at 0: any stride serves, and 0 keeps the promise
                elif hinted and v % DIVISIBILITY:
                    raise FlashgenError(f"{self.wl.op_name}: tensor '{tensor}' stride {v} on axis {axis} is "
                                        f"not a multiple of {DIVISIBILITY}, as this binary assumes; pass a contiguous tensor")
                out.append(v)
            elif kind == _DIM:
                out.append(dims[name])
            elif kind == _PARAM:
                out.append(float(params[name]))
            elif kind == _SCRATCH:
                buf = self.scratch(tensor, dims, next(iter(tensors.values())).device)
                out.append(buf.data_ptr() if native else buf)
            else:
                out.append(value)
        return out

    def plan(self, dims: Mapping[str, int]) -> tuple[int, tuple[int, int, int]]:
        """The call's row count and grid, remembered per dims."""
        key = tuple(dims.values())
        found = self._plans.get(key)
        if found is None:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            rows = eval_int(self.wl.op.domain[0], dims)
            found = self._plans[key] = (rows, grid(self.ks, self.wl, rows, int(self.target.sm_count), dims))
        return found

    def _check_device(self, device: torch.device) -> int:
        """The GPU's index, checked once to be of the target's architecture. A binary is loaded on the
        first GPU it runs on (by either launcher), and its function handle serves that GPU only."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index != self._device:
            if self._device is not None:
                raise FlashgenError(f"{self.wl.op_name}: this kernel's binary is loaded on cuda:{self._device}; "
                                    f"compile the workload again for tensors on cuda:{index}")
            arch = device_arch(device)
            if arch != self.target.arch:
                raise FlashgenError(f"kernel built for {self.target.key} cannot run on this {arch} GPU; "
                                    f"compile it for the running device's target")
            with torch.cuda.device(index):  # loaded on the tensors' GPU, whichever is current
                self.compiled._init_handles()
            self._device = index
        return index

    def _native_launch(self, index: int) -> NativeLaunch | None:
        """The lean launch of the binary (made at the first launch on a GPU), or None."""
        if self._native is _UNSET:
            kinds = "".join(KIND[a.kind] for a in self.ks.args if a.kind in KIND)
            self._native = native_launch(self.compiled, kinds, index)
        return self._native  # type: ignore[return-value]

    def bind(self, tensors: Mapping[str, torch.Tensor], params: Mapping[str, float],
             dims: Mapping[str, int]) -> Callable[[], None]:
        """This call with its arguments gathered once (`Kernel.bind`): the native launch on the stream
        current at each call, where it applies."""
        device = next(iter(tensors.values())).device
        rows, g = self.plan(dims)
        if device.type != "cuda" or rows == 0 or self.compiled is None:
            return partial(self, tensors, params, dims)
        index = self._check_device(device)
        native = self._native_launch(index)
        if native is None:
            return partial(self, tensors, params, dims)
        values, stream = self.args(tensors, params, dims, native=True), torch._C._cuda_getCurrentRawStream
        launch, static, (gx, gy, gz) = native.launch, native.static, g
        return lambda: launch(static, gx, gy, gz, stream(index), *values)

    def __call__(self, tensors: Mapping[str, torch.Tensor], params: Mapping[str, float],
                 dims: Mapping[str, int]) -> None:
        rows, g = self.plan(dims)
        if rows == 0:
            return
        device = next(iter(tensors.values())).device
        if device.type == "cpu":
            if not interpreting():
                raise FlashgenError(f"a {self.target.key} kernel runs on CPU tensors only under Triton's "
                                    "interpreter (start Python with TRITON_INTERPRET=1); for CPU work "
                                    "compile for target cpu")
            if uses_pdl(self.ks):  # (Triton raises an InterpreterError naming no cause)
                raise FlashgenError(f"this kernel was built for {self.target.id} with programmatic dependent launch, "
                                    "which Triton's interpreter does not run: call it on its GPU, or build and "
                                    "call it with FLASHGEN_PDL=0 set to check it in the interpreter")
            if self._interpreted is None:
                self._interpreted = load_function(self.ks)
            self._interpreted[g](*self.args(tensors, params, dims))
            return
        if self.compiled is None:
            raise FlashgenError("this kernel was not compiled; build it in a process without TRITON_INTERPRET=1")
        index = self._check_device(device)
        native = self._native_launch(index)
        if native is not None:
            native.launch(native.static, *g, torch._C._cuda_getCurrentRawStream(index),
                          *self.args(tensors, params, dims, native=True))
            return
        if self._global_scratch:
            _ensure_scratch_allocator()
        self.compiled[g](*self.args(tensors, params, dims))
