"""The kernels a linear's call launches on a GPU, recorded instead of run.

`linear.apply(x, q, ..., ops=Recorder())` walks the same code a decode step does (the mode's `gemm`,
the norm and gate that feed it, the activation quantization of the int8 modes), but each
`torch.ops.flashgen` op it calls is only bound to its Workload, as dispatch binds it, and answered with
empty outputs of the kernel's shapes. So the workloads the decoder dispatches in each mode are read off
its own code, on any device (meta tensors for the activations: nothing is computed): the mixed mode
estimates its modes' GEMMs from them (runtime/decoder/mixed.py) and
benchmarks/studies/decode_workloads.py writes the workloads to tune.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from flashgen.oplib import get_op
from flashgen.runtime.decoder.linear import PLAIN, CallForm, apply
from flashgen.runtime.serving.torch_ops import dispatcher, empty_outputs, split_call
from flashgen.workload import Workload


class Recorder:
    """Stands for `torch.ops.flashgen`: `calls` holds each launched op's workload in launch order."""

    def __init__(self) -> None:
        self.calls: list[Workload] = []

    def launched(self, wl: Workload) -> None:
        """Notes a kernel launched outside the recorded code (a decode step's attention before o)."""
        self.calls.append(wl)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        op = get_op(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            tensors, _, attrs, dims = split_call(op, args, kwargs)
            self.calls.append(dispatcher().workload_for(name, tensors, attrs, dims))
            return empty_outputs(op, tensors, attrs, dims)
        return call

    def behind(self, wl: Workload) -> Workload | None:
        """The kernel launched just before the last launch of `wl` (the producer a decode step times it
        behind), None when it came first."""
        at = max(i for i, c in enumerate(self.calls) if c == wl)
        return self.calls[at - 1] if at else None


def call_workloads(q: Any, rows: int, dtype: torch.dtype, form: CallForm = PLAIN) -> list[Workload]:
    """The kernels a call of `rows` rows in `form` (runtime/decoder/linear.py `CallForm`: plain by
    default, no norm, gate, bias or residual) launches in `q`'s mode, in launch order: the GEMM, and
    before it the norm or gate it does not fuse, or the int8 modes' activation quantization."""
    n, k = q.shape
    meta = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")
    rec = Recorder()
    apply(meta(rows, 2 * k if form.gated else k), q, meta(n) if form.bias else None, set(),
          norm=meta(k) if form.norm else None, gated=form.gated, residual=meta(rows, n) if form.residual else None,
          ops=rec)
    return rec.calls


def gemm_workload(q: Any, rows: int, dtype: torch.dtype, form: CallForm = PLAIN) -> Workload:
    """The GEMM of such a call (`call_workloads`): the last contraction launched."""
    return next(wl for wl in reversed(call_workloads(q, rows, dtype, form)) if wl.op.kclass == "contraction")
