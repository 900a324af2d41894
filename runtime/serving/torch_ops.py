"""Every op as a torch.library custom op, `torch.ops.flashgen.<op>`, with a fake (meta) implementation
so that it works inside torch.compile and CUDA-graph capture.

The schema comes from the op's description: its inputs in order (those it updates in place, such as a
KV cache, marked mutable), then its params (floats with their
defaults) and its string attrs (dtype defaults to the first input's, which an int8 or fp8 GEMM must
override with its output dtype); it returns the op's outputs. Dims no tensor shape determines are passed as a trailing `int[] dims` in the op's dim order
(empty when the shapes say everything). CPU tensors run the `cpu` target's kernels, CUDA tensors the
running GPU's; the dispatcher picks the schedule.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from flashgen.errors import FlashgenError
from flashgen.ir import dtypes
from flashgen.ir.op import Op, eval_int
from flashgen.oplib import OPS
from flashgen.runtime.serving.dispatch import Dispatcher, bind_shapes

_LIB = torch.library.Library("flashgen", "DEF")
_DISPATCHER = Dispatcher()
_REGISTERED: set[str] = set()


def dispatcher() -> Dispatcher:
    return _DISPATCHER


def _attr_names(op: Op) -> list[str]:
    return list(op.attrs)


def _attr_default(op: Op, a: str) -> str:
    return "" if a == "dtype" else op.attrs[a][0]  # "": the first input's dtype


def schema(op: Op) -> str:
    """The op's schema: tensors (optional ones as Tensor?, None when left out), params, attrs, dims; returns its outputs."""
    written = iter("abcdefghijklmnopqrstuvwxyz")  # inputs updated in place get an alias set each: Tensor(a!)
    args = [f"Tensor? {t.name}=None" if t.when else f"Tensor({next(written)}!) {t.name}" if t.written
            else f"Tensor {t.name}" for t in op.inputs]  # optional ones trail
    args += [f"float {p}={v!r}" for p, v in op.params.items()]
    args += [f"str {a}='{_attr_default(op, a)}'" for a in _attr_names(op)]
    args.append("int[] dims=[]")
    n_out = len(op.outputs_for({a: v[0] for a, v in op.attrs.items()}))  # the same for every attr value
    outs = ", ".join("Tensor" for _ in range(n_out))
    return f"{op.name}({', '.join(args)}) -> " + (f"({outs})" if n_out != 1 else outs)  # "()": updates in place only


def _defaults(op: Op) -> list[Any]:
    return [None] * len(op.inputs) + list(op.params.values()) + [_attr_default(op, a) for a in _attr_names(op)] + [[]]


def _splitter(op: Op) -> Callable[[tuple], tuple[dict, dict, dict, dict]]:
    """`split(args)`: the tensors, params, attrs and given dims of a call (arguments left out take their
    defaults); the op's argument layout is worked out once, as calls are hot."""
    defaults = _defaults(op)
    inputs, params, attrs = [t.name for t in op.inputs], list(op.params), _attr_names(op)
    n_in, n_par, n_att = len(inputs), len(params), len(attrs)

    def split(args: tuple) -> tuple[dict, dict, dict, dict]:
        args = tuple(args) + tuple(defaults[len(args):])
        tensors = {n: x for n, x in zip(inputs, args[:n_in]) if x is not None}
        par = dict(zip(params, args[n_in:n_in + n_par]))
        att = {a: v for a, v in zip(attrs, args[n_in + n_par:n_in + n_par + n_att]) if v != ""}
        dims = dict(zip(op.dims, args[n_in + n_par + n_att])) if args[n_in + n_par + n_att] else {}
        return tensors, par, att, dims

    return split


def split_call(op: Op, args: tuple, kwargs: Mapping[str, Any]) -> tuple[dict, dict, dict, dict]:
    """The tensors, params, attrs and given dims of a call written as `torch.ops.flashgen.<op>(*args,
    **kwargs)` is (`runtime/decoder/calls.py` records calls so, without running them)."""
    names = [t.name for t in op.inputs] + list(op.params) + _attr_names(op) + ["dims"]
    given = {**dict(zip(names, args)), **kwargs}
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise FlashgenError(f"{op.name}: no argument {', '.join(unknown)}")
    return _splitter(op)(tuple(given.get(n, d) for n, d in zip(names, _defaults(op))))


def empty_outputs(op: Op, tensors: Mapping[str, torch.Tensor], attrs: Mapping[str, str],
                  dims: Mapping[str, int]) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
    """The op's outputs for a call, uninitialized, on the first input's device: shapes and dtypes as
    the kernel would write them (the fake implementation)."""
    first = next(iter(tensors.values()))
    full = {**{a: v[0] for a, v in op.attrs.items()}, "dtype": dtypes.of_torch(first.dtype), **attrs}
    # (a dim an attr sets, moe_route's K by its topk, shapes outputs that no input shows)
    bound = {**bind_shapes(op.name, tensors, dims), **{d: int(full[a]) for d, a in op.attr_dims.items()}}
    if "dtype" not in op.attrs:
        full.pop("dtype")
    vals = tuple(first.new_empty(tuple(eval_int(e, bound) for e in t.shape), dtype=dtypes.TORCH[op.dtype_of(t.name, full)])
                 for t in op.outputs if t.present(full))
    return vals[0] if len(vals) == 1 else vals or None


def check_tables(op_name: str, tensors: Mapping[str, torch.Tensor], given: Mapping[str, int]) -> None:
    """A paged cache's lengths and the block-table entries they use must lie inside the cache: a kernel
    reads whatever they point at. Checked on CPU tensors only, where it costs no wait for a device."""
    lens_name = next((n for n in ("context_lens", "prefix_lens") if n in tensors), None)
    if lens_name is None or "block_tables" not in tensors or tensors["block_tables"].device.type != "cpu":
        return
    dims = bind_shapes(op_name, tensors, given)
    lens, tables, cap = tensors[lens_name].long(), tensors["block_tables"].long(), dims["MAXB"] * dims["BS"]
    low = 1 if lens_name == "context_lens" else 0
    if lens.numel() and not (low <= int(lens.min()) and int(lens.max()) <= cap):
        raise FlashgenError(f"{op_name}: {lens_name} must lie in [{low}, MAXB*BS={cap}], got {lens.tolist()}")
    used = torch.arange(tables.shape[1])[None, :] < (lens[:, None] + dims["BS"] - 1) // dims["BS"]
    bad = used & ((tables < 0) | (tables >= dims["NB"]))
    if bool(bad.any()):
        b, j = (int(i) for i in bad.nonzero()[0])
        raise FlashgenError(f"{op_name}: block_tables[{b}, {j}] = {int(tables[b, j])} is outside the cache's "
                            f"NB={dims['NB']} blocks")


def register(op: Op) -> None:
    """Define flashgen::<op> with its real and fake implementations (idempotent)."""
    if op.name in _REGISTERED:
        return
    _LIB.define(schema(op))

    split = _splitter(op)

    def real(*args: Any):
        tensors, params, attrs, dims = split(args)
        check_tables(op.name, tensors, dims)
        kernel = _DISPATCHER.kernel(op.name, tensors, attrs, dims)
        vals = tuple(kernel.run(tensors, params=params).values())  # in the op's output order
        return vals[0] if len(vals) == 1 else vals or None

    def fake(*args: Any):
        tensors, _, attrs, dims = split(args)
        return empty_outputs(op, tensors, attrs, dims)

    for key in ("CPU", "CUDA"):
        _LIB.impl(op.name, real, key)
    torch.library.register_fake(f"flashgen::{op.name}", lib=_LIB)(fake)
    _REGISTERED.add(op.name)


def register_all() -> None:
    for op in OPS.values():
        register(op)
