"""Generated Triton files a person can run: `python <op>_kernel.py` checks and times the kernel.

`flashgen compile --out` writes the generated module with two additions after the kernel, neither of
which the compiled binary sees: GRID, the programs the runtime launches for the workload's own dims,
and a `__main__` block calling `main` below. Run as it is, the file launches its own kernel (edits
included) on fresh random inputs of its workload, compares every output with the op's float64
reference and, on a GPU, prints the median time; without a GPU, `TRITON_INTERPRET=1` runs it in
Triton's interpreter on CPU tensors, except a Gluon kernel and one that multiplies bf16 matrices with
tl.dot (the interpreter computes those wrongly): those are refused there in one line saying why.
Arguments `DIM=VALUE` change run-time dims (the rows), e.g. a smaller M for the interpreter.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from flashgen.errors import FlashgenError
from flashgen.targets.descriptor import Target
from flashgen.targets.triton.emit import KernelSource
from flashgen.workload import Schedule, Workload

RUN_HINT = "python {file} [DIM=VALUE ...]   (without a GPU: TRITON_INTERPRET=1 python {file})"
GLUON_HINT = "python {file} [DIM=VALUE ...]   (on an NVIDIA sm_90 GPU: Triton's interpreter does not run Gluon)"
BF16_DOT_HINT = ("python {file} [DIM=VALUE ...]   (on a GPU: Triton's interpreter computes bf16 tl.dot wrongly; "
                 "compile the workload in fp16 to check it there)")


def bf16_dot(wl: Workload) -> bool:
    """Whether the kernel multiplies bf16 matrices with tl.dot (a contraction of bf16 operands; attention
    in bf16, whose dots take the activation dtype), which Triton's interpreter computes wrongly: it
    multiplies their raw bits (docs/toolchain.md). Its check there would say WRONG of a right kernel."""
    from flashgen.ir.op import Attend, Contract

    return any((isinstance(st, Contract) and st.operand_dtype(wl.attr) == "bf16")
               or (isinstance(st, Attend) and wl.attr.get("dtype") == "bf16") for st in wl.op.body(wl.attr))


def _hint(ks: KernelSource, wl: Workload, file: str) -> str:
    hint = GLUON_HINT if ks.dialect == "gluon" else BF16_DOT_HINT if bf16_dot(wl) else RUN_HINT
    return hint.format(file=file)


def runnable_source(ks: KernelSource, wl: Workload, schedule: Schedule, target: Target) -> str:
    """The module text of `ks` with its launch grid and the harness call appended."""
    from flashgen.targets.triton.codegen import grid

    file = f"{ks.name}.py"
    g = grid(ks, wl, sm_count=int(target.sm_count))
    rows = ", ".join(f"{d}={wl.dim[d]}" for d in wl.op.row_dims)
    return (ks.source.rstrip("\n") + "\n\n\n"
            f"# Programs (x, y, z) the runtime launches for {rows}; other run-time dims launch others.\n"
            f"GRID = {g}\n\n\n"
            f"if __name__ == \"__main__\":  # {_hint(ks, wl, file)}\n"
            "    import sys\n\n"
            "    from flashgen.targets.triton.harness import main\n"
            f"    sys.exit(main(__file__, {json.dumps(wl.to_json(), sort_keys=True)},\n"
            f"                  {json.dumps(dict(schedule), sort_keys=True)}, {target.key!r}, sys.argv[1:]))\n")


def _row_dims(wl: Workload, argv: Sequence[str]) -> Workload:
    dims = dict(wl.dim)
    for arg in argv:
        name, _, value = arg.partition("=")
        if name not in wl.op.row_dims or not value.isdigit() or int(value) < 1:
            raise FlashgenError(f"arguments are run-time dims as DIM=VALUE, DIM one of {', '.join(wl.op.row_dims)}; "
                                f"got {arg!r}")
        dims[name] = int(value)
    return Workload.from_json({**wl.to_json(), "dims": dims})


def main(path: str, workload_json: Mapping[str, Any], schedule: Schedule, target_key: str,
         argv: Sequence[str] = (), seed: int = 0) -> int:
    """Check (and on a GPU, time) the kernel of the file at `path`; 0 when every output is right."""
    import torch

    from flashgen.check import check
    from flashgen.kernel_classes import current_schedule
    from flashgen.targets.descriptor import get_target
    from flashgen.targets.kernel import bind_dims
    from flashgen.targets.triton.build import interpreting, load_function
    from flashgen.targets.triton.codegen import generate
    from flashgen.targets.triton.launch import TritonLauncher

    try:
        wl = _row_dims(Workload.from_json(dict(workload_json)), argv)
        target = get_target(target_key)
        # the kernel as this file has it; the generator gives its arguments' recipe and tiling
        ks = replace(generate(wl, current_schedule(wl, schedule)), source=Path(path).read_text(encoding="utf-8"))
        hint = _hint(ks, wl, Path(path).name)
        if ks.dialect == "gluon" and (interpreting() or not torch.cuda.is_available()
                                      or torch.cuda.get_device_capability()[0] != 9):
            raise FlashgenError("a Gluon kernel runs on its NVIDIA sm_90 GPU alone: " + hint)
        if (interpreting() or not torch.cuda.is_available()) and bf16_dot(wl):
            raise FlashgenError("this kernel is checked on a GPU alone: Triton's interpreter multiplies the raw bits "
                                "of bf16 matrices in tl.dot, so its check would say WRONG of a right kernel "
                                "(compile the workload with --dtype fp16 to check that kernel in the interpreter)")
        if not interpreting() and not torch.cuda.is_available():
            raise FlashgenError("no GPU here: run it in Triton's interpreter, " + hint)
        fn = load_function(ks)
    except FlashgenError as e:
        print(f"flashgen: error: {e}", file=sys.stderr)
        return 2
    launcher = TritonLauncher(ks, wl, target)
    device = torch.device("cpu" if interpreting() else "cuda")

    def run(inputs: Mapping[str, torch.Tensor], outputs: Mapping[str, torch.Tensor],
            params: Mapping[str, float]) -> None:
        tensors, dims = {**inputs, **outputs}, bind_dims(wl, inputs)
        _, g = launcher.plan(dims)
        fn[g](*launcher.args(tensors, params, dims))

    checks = check(wl, run, seed, device)
    for c in checks:
        print(f"{c.tensor}: error {c.error:.2e} (tolerance {c.tolerance:g}) {'ok' if c.ok else 'WRONG'}"
              + (f", {c.detail}" if c.detail else ""))
    if device.type == "cuda" and all(c.ok for c in checks):
        import triton.testing

        from flashgen.check import poisoned
        inputs = {k: v.to(device) for k, v in wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(seed)).items()}
        outputs = poisoned(wl, wl.dim, device)
        us = 1e3 * triton.testing.do_bench(lambda: run(inputs, outputs, wl.op.params), return_mode="median")
        print(f"{wl}: {us:.2f} us (median)")
    return 0 if all(c.ok for c in checks) else 1
