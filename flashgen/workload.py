"""Workload: an op with every dim bound and its attrs (dtypes, style); canonical JSON and a stable key."""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from flashgen.errors import FlashgenError
from flashgen.ir.op import Op, eval_int
from flashgen.oplib import get_op

# A schedule is one point of a kernel class's ScheduleSpace: knob name -> integer value, JSON as it is.
Schedule = dict[str, Any]

MAX_DIM = 1 << 24          # any single dim
MAX_ELEMENTS = 1 << 36     # any single tensor


@dataclass(frozen=True)
class Workload:
    op_name: str
    dims: tuple[tuple[str, int], ...]
    attrs: tuple[tuple[str, str], ...]

    @property
    def op(self) -> Op:
        return get_op(self.op_name)

    @property
    def dim(self) -> dict[str, int]:
        return dict(self.dims)

    @property
    def attr(self) -> dict[str, str]:
        return dict(self.attrs)

    @property
    def dtype(self) -> str:
        return self.attr["dtype"]

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op_name, "dims": self.dim, "attrs": self.attr}

    def canonical(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    def key(self) -> str:
        """Stable across runs and versions: the op name plus a hash of the canonical JSON."""
        return f"{self.op_name}-{hashlib.sha256(self.canonical().encode()).hexdigest()[:16]}"

    @property
    def inputs(self):
        """The op's input TensorSpecs present for these attrs (an epilogue's bias only when asked for)."""
        return self.op.inputs_for(self.attr)

    @property
    def outputs(self):
        return self.op.outputs_for(self.attr)

    def shape(self, tensor: str) -> tuple[int, ...]:
        return tuple(eval_int(e, self.dim) for e in self.op.tensors[tensor].shape)

    def tensor_dtype(self, tensor: str) -> str:
        return self.op.dtype_of(tensor, self.attr)

    def with_dims(self, **dims: int) -> Workload:
        return workload(self.op_name, **{**self.dim, **dims, **self.attr})

    def __str__(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.dims)
        attrs = " ".join(f"{k}={v}" for k, v in self.attrs)
        return f"{self.op_name} {dims} {attrs}"

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Workload:
        try:
            return workload(d["op"], **d["dims"], **d.get("attrs", {}))
        except (KeyError, TypeError) as e:
            raise FlashgenError(f"not a workload JSON object ({e}): {d}") from None


def domain(wl: Workload) -> tuple[int, int]:
    """The (rows, cols) extent of the op's iteration domain for this workload's dims."""
    rows, cols = wl.op.domain
    return eval_int(rows, wl.dim), eval_int(cols, wl.dim)


def recorded_workload(workload_json: Mapping[str, Any], workload_key: str) -> Workload | None:
    """The workload a tuning record measured, as flashgen defines it today: None when its op is unknown
    or has changed since (an attribute added, such as a new weight layout, gives another key: the
    record measured another kernel)."""
    try:
        wl = Workload.from_json(workload_json)
    except FlashgenError:
        return None
    return wl if wl.key == workload_key else None


def read_workloads(path: str) -> list[Workload]:
    """One workload per non-blank line of a JSON-lines file ({op, dims, attrs}); a bad line is an error
    naming the file and line."""
    return [wl for wl, _ in read_workload_lines(path)]


WORKLOAD_KEYS = ("op", "dims", "attrs")  # what Workload.from_json reads


def parse_workload(d: Any, where: str, more: tuple[str, ...] = ()) -> Workload:
    """A workload from a user's JSON ({op, dims, attrs} and the keys `more` allows): any other key is
    refused by name, since from_json would skip it and a typo ("attr") would name another workload."""
    keys = WORKLOAD_KEYS + more
    if not isinstance(d, dict):
        raise FlashgenError(f"{where}: must be a JSON object {{{', '.join(keys)}}}, got {json.dumps(d)[:40]}")
    unknown = sorted(set(d) - set(keys))
    if unknown:
        raise FlashgenError(f"{where}: unknown key {', '.join(map(repr, unknown))} (a workload has {', '.join(keys)})")
    try:
        return Workload.from_json(d)
    except FlashgenError as e:
        raise FlashgenError(f"{where}: {e}") from None


def read_workload_lines(path: str) -> list[tuple[Workload, Workload | None]]:
    """Each non-blank line's workload and the producer it names under "behind" ({op, dims, attrs}: the
    kernel `flashgen tune` times it behind), else None. The file must be UTF-8; a bad line is refused
    with its number, and a file with no workload too (it would tune nothing and succeed)."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FlashgenError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FlashgenError(f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    out = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 is text
        if line.strip():
            where = f"{path}:{n}"
            try:
                d = json.loads(line)
            except (ValueError, RecursionError) as e:  # (numbers past int's digit limit are ValueErrors too)
                raise FlashgenError(f"{where}: not JSON ({e})") from None
            behind = d.get("behind") if isinstance(d, dict) else None
            out.append((parse_workload(d, where, ("behind",)),
                        None if behind is None else parse_workload(behind, f"{where}: behind")))
    if not out:
        raise FlashgenError(f"{path} holds no workload; give one {{op, dims, attrs}} per line")
    return out


def other_half(attrs: Mapping[str, str]) -> dict[str, str]:
    """The attrs with dtype fp16 and bf16 swapped; empty when the dtype is neither (fp16 and bf16
    kernels of one schedule run alike, so a schedule tuned in one serves the other)."""
    swap = {"fp16": "bf16", "bf16": "fp16"}
    return {**attrs, "dtype": swap[attrs["dtype"]]} if attrs.get("dtype") in swap else {}


@functools.lru_cache(maxsize=1024)
def dequant_forms(wl: Workload, chunks: int = 1) -> tuple[Workload, Workload] | None:
    """(the pointwise workload that writes `wl`'s weight dequantized, the dense contraction workload
    that runs on it, on N / chunks of the weight's rows at a time) when the op has a weight prologue
    (`Op.dequant`), else None: each binds the dims and attrs of `wl` that its op has."""
    if not wl.op.dequant:
        return None

    def bind(name: str, **dims: int) -> Workload:
        o = get_op(name)
        return workload(name, **{d: v for d, v in {**wl.dim, **dims}.items() if d in o.dims},
                        **{a: v for a, v in wl.attr.items() if a in o.attrs})

    stage, dense = wl.op.dequant
    return bind(stage), bind(dense, N=wl.dim["N"] // chunks)


def workload(op: str, **kw: Any) -> Workload:
    """Bind an op's dims and attrs, validating each: `workload("rmsnorm", M=4096, N=8192, dtype="bf16")`."""
    o = get_op(op)
    dims: dict[str, int] = {}
    attrs: dict[str, str] = {}
    for name, value in kw.items():
        if name in o.dims:
            dims[name] = _check_dim(o, name, value)
        elif name in o.attrs:
            if value not in o.attrs[name]:
                raise FlashgenError(f"{op}: {name}={value} is not supported; valid: {', '.join(o.attrs[name])}")
            attrs[name] = value
        else:
            valid = ", ".join(list(o.dims) + list(o.attrs))
            raise FlashgenError(f"{op}: unknown dim or attribute '{name}'; valid: {valid}")
    for name, choices in o.attrs.items():
        attrs.setdefault(name, choices[0])
    for d, a in o.attr_dims.items():
        if dims.setdefault(d, int(attrs[a])) != int(attrs[a]):
            raise FlashgenError(f"{op}: dim {d}={dims[d]} contradicts {a}={attrs[a]} (which sets it)")
    missing = [d for d in o.dims if d not in dims]
    if missing:
        raise FlashgenError(f"{op}: missing dim {', '.join(missing)} (needs {', '.join(o.dims)})")
    problem = o.check_dims(dims, attrs)
    if problem:
        raise FlashgenError(f"{op}: {problem}")
    for t in o.inputs_for(attrs) + o.outputs_for(attrs):
        n = 1
        for e in t.shape:
            n *= eval_int(e, dims)
        if n > MAX_ELEMENTS:
            raise FlashgenError(f"{op}: tensor {t.name} would hold {n} elements, over the limit of {MAX_ELEMENTS}")
    return Workload(op, tuple((d, dims[d]) for d in o.dims), tuple(sorted(attrs.items())))


def _check_dim(op: Op, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(str(value), 10)
        except ValueError:
            raise FlashgenError(f"{op.name}: dim {name} must be an integer, got {value!r}") from None
    if value <= 0:
        raise FlashgenError(f"{op.name}: dim {name} must be positive, got {value}")
    if value > MAX_DIM:
        raise FlashgenError(f"{op.name}: dim {name}={value} is absurd (the limit is {MAX_DIM})")
    return value
