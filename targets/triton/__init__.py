"""Triton backend: one generated source, compiled ahead of time for CUDA (PTX/cubin) and ROCm (AMDGCN/HSACO)."""
from __future__ import annotations

import triton
import torch

from flashgen.schedules.space import Schedule
from flashgen.targets.descriptor import Target
from flashgen.targets.kernel import Kernel
from flashgen.targets.triton.build import artifacts, compile_aot
from flashgen.targets.triton.codegen import generate
from flashgen.targets.triton.launch import TritonLauncher
from flashgen.workload import Workload


def build(wl: Workload, schedule: Schedule, target: Target) -> Kernel:
    ks = generate(wl, schedule)
    ck = compile_aot(ks, wl, schedule, target)
    asm, binary, kind = artifacts(ck, target)
    meta = {"kernel_name": ks.name, "binary_symbol": ck.metadata.name, "backend": "triton",
            "num_warps": schedule["num_warps"], "shared_bytes": ck.metadata.shared,
            "signature": [a.name for a in ks.args],
            "constexprs": {a.name: a.value for a in ks.args if a.kind == "constexpr"},
            "tools": {"triton": triton.__version__, "torch": torch.__version__}}
    return Kernel(workload=wl, target=target, schedule=schedule, name=ks.name, source=ks.source, asm=asm,
                  binary=binary, binary_kind=kind, metadata=meta,
                  launcher=TritonLauncher(ks, wl, target, ck))
