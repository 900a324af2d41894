"""Kernel: generated source + binary + metadata for one (workload, schedule, target), callable on tensors.

Calling a kernel checks the tensors against the workload (row dims such as M may differ from the
tuned value; every other dim is compiled in), allocates the outputs and launches through the backend's
launcher: the binary on a matching GPU, Triton's interpreter on CPU tensors for a GPU target, the
compiled module for the `cpu` target.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from flashgen.errors import FlashgenError
from flashgen.ir import dtypes
from flashgen.ir.op import eval_int
from flashgen.ir.expr import Dim
from flashgen.targets.descriptor import Target
from flashgen.workload import Schedule, Workload

MAX_CALL_SIGNATURES = 4096  # remembered per kernel (and per dispatcher)
Launcher = Callable[[Mapping[str, torch.Tensor], Mapping[str, float], Mapping[str, int]], None]


def bind_dims(wl: Workload, inputs: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """Dims of this call: row dims read off the inputs, the rest the workload's; shapes, dtypes and
    layouts checked so that a bad call is an error, not a wrong answer."""
    op = wl.op
    dims = dict(wl.dim)
    for t in wl.inputs:
        if t.name not in inputs:
            raise FlashgenError(f"{op.name}: missing input '{t.name}' (inputs: {', '.join(i.name for i in wl.inputs)})")
        for axis, e in enumerate(t.shape):
            if isinstance(e, Dim) and e.name in op.row_dims and axis < inputs[t.name].dim():
                dims[e.name] = inputs[t.name].shape[axis]
    for t in wl.inputs:
        x = inputs[t.name]
        want = tuple(eval_int(e, dims) for e in t.shape)
        if tuple(x.shape) != want:
            raise FlashgenError(f"{op.name}: input '{t.name}' has shape {tuple(x.shape)}, expected {want}")
        want_dt = dtypes.TORCH[wl.tensor_dtype(t.name)]
        if x.dtype != want_dt:
            raise FlashgenError(f"{op.name}: input '{t.name}' is {x.dtype}, this kernel takes {want_dt}")
        if x.numel() and x.stride(-1) != 1 and x.shape[-1] != 1:  # (a size-1 dim's stride is never used)
            raise FlashgenError(f"{op.name}: input '{t.name}' needs a contiguous last dimension")
    same_device(op.name, inputs)
    return dims


def same_device(op_name: str, tensors: Mapping[str, torch.Tensor]) -> torch.device:
    """The one device of a call's tensors: a kernel given a pointer of another device would read or
    write memory it does not own, so a mixed call is refused, naming the tensor that differs."""
    names = iter(tensors)
    first = next(names)
    device = tensors[first].device
    for name in names:
        if tensors[name].device != device:
            raise FlashgenError(f"{op_name}: '{name}' is on {tensors[name].device}, '{first}' on {device}; "
                                f"every tensor of a call must be on one device")
    return device


def check_outputs(op_name: str, given: Mapping[str, torch.Tensor],
                  specs: list[tuple[str, tuple[int, ...], torch.dtype]], device: torch.device) -> None:
    """Given outputs are written in place: each must have the op's shape and dtype, lie on the
    inputs' device and be contiguous (the kernel writes it as one dense block), or the launch would
    write out of its bounds."""
    if set(given) != {name for name, _, _ in specs}:
        raise FlashgenError(f"{op_name}: outputs {sorted(given)} given, the op writes "
                            f"{sorted(name for name, _, _ in specs)}")
    for name, shape, dt in specs:
        y = given[name]
        if tuple(y.shape) != shape or y.dtype != dt:
            raise FlashgenError(f"{op_name}: output '{name}' is {y.dtype} {tuple(y.shape)}, "
                                f"expected {dt} {shape}")
        if y.device != device:
            raise FlashgenError(f"{op_name}: output '{name}' is on {y.device}, the inputs on {device}")
        if not y.is_contiguous():
            raise FlashgenError(f"{op_name}: output '{name}' must be contiguous")


@dataclass(frozen=True)
class BoundCall:
    """A checked call of a kernel on fixed tensors (`Kernel.bind`): calling it launches again."""
    launch: Callable[[], None]
    outputs: dict[str, torch.Tensor]

    def __call__(self) -> None:
        self.launch()


@dataclass
class Kernel:
    workload: Workload
    target: Target
    schedule: Schedule
    name: str
    source: str                 # generated source (Triton Python, or TVMScript for the cpu target)
    asm: dict[str, str]         # "ptx" / "amdgcn" / "llvm" ..., plus intermediate IR texts
    binary: bytes
    binary_kind: str            # "cubin" | "hsaco" | "so"
    metadata: dict[str, Any]
    launcher: Launcher = field(repr=False)
    # A kernel of several launches (a weight dequantized first, then the dense GEMM: targets/staged.py)
    # keeps each launch's kernel here, in order; its own source, asm and binary are the last one's.
    parts: tuple["Kernel", ...] = field(default=(), repr=False)
    # The source as a file a person can run, where the backend makes one (Triton: with its launch grid
    # and a harness that checks and times it; targets/triton/harness.py); `--out` writes it.
    runnable: str = field(default="", repr=False)
    # Per call signature (each input's shape, dtype and strides): the checked dims and the outputs'
    # shapes and dtypes, so a repeated call skips the checks (decode calls the same shapes all along).
    _calls: dict[tuple, tuple[dict[str, int], list[tuple[str, tuple[int, ...], torch.dtype]]]] = field(
        default_factory=dict, repr=False, compare=False)
    _input_names: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._input_names = tuple(t.name for t in self.workload.inputs)

    def _signature(self, inputs: Mapping[str, torch.Tensor]) -> tuple | None:
        """Each input's shape, dtype, strides (all of them: one call costs less than asking for the
        last) and device, when the inputs are the op's tensors in order; else None (the full check then says what
        is wrong)."""
        if tuple(inputs) != self._input_names:
            return None
        try:
            return tuple([(x.shape, x.dtype, x.stride(), x.device) for x in inputs.values()])
        except AttributeError:
            return None

    def __call__(self, *inputs: torch.Tensor, **params: float) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run on tensors given in the op's input order; returns the op's outputs (one, or a tuple)."""
        op = self.workload.op
        ins, outs_spec = self.workload.inputs, self.workload.outputs
        if len(inputs) != len(ins):
            raise FlashgenError(f"{op.name} takes {len(ins)} inputs "
                                f"({', '.join(t.name for t in ins)}), got {len(inputs)}")
        outs = self.run(dict(zip((t.name for t in ins), inputs)), params=params)
        vals = tuple(outs[t.name] for t in outs_spec)
        return vals[0] if len(vals) == 1 else vals

    def _prepare(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor] | None,
                 params: Mapping[str, float] | None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                                            Mapping[str, float], dict[str, int]]:
        """A call's checked tensors (inputs and outputs, the outputs allocated when not given), its
        params and its dims."""
        op = self.workload.op
        if params and not params.keys() <= op.params.keys():
            unknown = set(params) - set(op.params)
            raise FlashgenError(f"{op.name}: unknown parameter {', '.join(sorted(unknown))}; "
                                f"valid: {', '.join(op.params) or 'none'}")
        sig = self._signature(inputs)
        bound = self._calls.get(sig) if sig is not None else None
        if bound is None:
            dims = bind_dims(self.workload, inputs)
            bound = (dims, [(t.name, tuple(eval_int(e, dims) for e in t.shape),
                             dtypes.TORCH[self.workload.tensor_dtype(t.name)]) for t in self.workload.outputs])
            if sig is not None:
                if len(self._calls) >= MAX_CALL_SIGNATURES:  # row counts of prefills vary without end
                    self._calls.clear()
                self._calls[sig] = bound
        dims, out_specs = bound
        device = next(iter(inputs.values())).device
        if outputs is not None:
            check_outputs(op.name, outputs, out_specs, device)
            outs = dict(outputs)
        else:
            outs = {name: torch.empty(shape, dtype=dt, device=device) for name, shape, dt in out_specs}
        return {**inputs, **outs}, outs, {**op.params, **params} if params else op.params, dims

    def run(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor] | None = None,
            params: Mapping[str, float] | None = None) -> dict[str, torch.Tensor]:
        """Launch into `outputs` (allocated when not given); returns the outputs by name."""
        tensors, outs, values, dims = self._prepare(inputs, outputs, params)
        self.launcher(tensors, values, dims)
        return outs

    def bind(self, inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor] | None = None,
             params: Mapping[str, float] | None = None) -> "BoundCall":
        """Check a call once and keep it: each call of the result launches the kernel again on the same
        tensors (which it keeps alive), with only the launch's own host cost. For loops over fixed
        buffers outside CUDA graphs; a launcher without a bound form is called as `run` would."""
        tensors, outs, values, dims = self._prepare(inputs, outputs, params)
        bind = getattr(self.launcher, "bind", None)
        launch = bind(tensors, values, dims) if bind else partial(self.launcher, tensors, values, dims)
        return BoundCall(launch, outs)

    def files(self) -> dict[str, bytes]:
        if self.parts:
            return {name: data for part in self.parts for name, data in part.files().items()}
        ext = {"triton": "py", "tvm": "tvm.py"}[self.target.backend]
        out = {f"{self.name}.{ext}": (self.runnable or self.source).encode(),
               f"{self.name}.{self.binary_kind}": self.binary}
        for kind, text in self.asm.items():
            out[f"{self.name}.{kind}"] = text.encode()
        return out

    def save(self, out_dir: str | os.PathLike) -> list[Path]:
        """Write source, binary, assembly and metadata JSON. The JSON, whose sha256 values describe every
        file, is removed first and written last: where it exists, the files beside it are the ones it
        describes, and a save cut short leaves none (its staging folder goes at the next save). Files
        the JSON it replaces listed and this save does not write (another target's binary, say) are
        removed with it, so the folder never mixes two kernels; other files are left alone."""
        out = Path(out_dir)
        meta_name = f"{self.name}.json"
        try:
            out.mkdir(parents=True, exist_ok=True)
            _remove_dead_stages(out)
            stage = Path(tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=out))
        except OSError as e:
            raise FlashgenError(f"cannot write to {out}: {e.strerror or e}") from None
        try:
            files = self.files()
            meta = {**self.metadata, "workload": self.workload.to_json(), "workload_key": self.workload.key,
                    "files": sorted(files) + [meta_name],
                    "sha256": {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}}
            files[meta_name] = (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode()
            for name, data in files.items():
                (stage / name).write_bytes(data)
            stale = _listed_files(out / meta_name) - set(files)
            (out / meta_name).unlink(missing_ok=True)
            for name in stale:
                if (out / name).is_symlink() or (out / name).is_file():
                    (out / name).unlink(missing_ok=True)
            for name in [*(n for n in files if n != meta_name), meta_name]:
                os.replace(stage / name, out / name)
            return [out / name for name in files]
        except OSError as e:
            raise FlashgenError(f"cannot write to {out}: {e.strerror or e}") from None
        finally:
            shutil.rmtree(stage, ignore_errors=True)


def _listed_files(meta: Path) -> set[str]:
    """The plain file names an earlier save's JSON lists (none where it is absent or unreadable: then
    nothing is known to be flashgen's, and nothing is removed)."""
    try:
        listed = json.loads(meta.read_text(encoding="utf-8")).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    if not isinstance(listed, list):
        return set()
    return {n for n in listed if isinstance(n, str) and n not in ("", ".", "..") and Path(n).name == n}


STAGE_PREFIX = ".flashgen-"  # staging folders of `Kernel.save`, named by the writing process's id


def _remove_dead_stages(out: Path) -> None:
    """Staging folders left by saves whose process is gone (killed mid-save)."""
    for stage in out.glob(f"{STAGE_PREFIX}*"):
        pid = stage.name[len(STAGE_PREFIX):].split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(stage, ignore_errors=True)
        except OSError:  # alive, another user's
            pass
