"""Triton backend: one generated source, compiled ahead of time for CUDA (PTX/cubin) and ROCm
(AMDGCN/HSACO), kept in the artifact cache so each kernel is compiled once."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import triton

from flashgen import __version__
from flashgen.targets import artifacts, staged
from flashgen.targets.descriptor import Target
from flashgen.targets.kernel import Kernel
from flashgen.targets.triton.build import ast_source, compile_aot, compile_options, for_target, load_compiled, stride_hints
from flashgen.targets.triton.codegen import generate
from flashgen.targets.triton.emit import KernelSource
from flashgen.targets.triton.harness import runnable_source
from flashgen.targets.triton.launch import TritonLauncher
from flashgen.workload import Schedule, Workload

ASM = {"cuda": ("ptx", "cubin"), "hip": ("amdgcn", "hsaco")}


def cache_key(ks: KernelSource, wl: Workload, schedule: Schedule, target: Target) -> str:
    """Everything the build reads: the source, its constants, the strides it is promised divisible
    (`stride_hints`: the binary relies on them), Triton's options and what the descriptor gives Triton
    (backend, architecture, warp size), not the descriptor's name."""
    return artifacts.artifact_key({"source": ks.source, "options": compile_options(ks, schedule),
                                   "constexprs": {a.name: a.value for a in ks.args if a.kind == "constexpr"},
                                   "divisible": stride_hints(ks, wl),
                                   "triton_target": list(target.triton_target), "warp_size": target.warp_size,
                                   "triton": triton.__version__, "flashgen": __version__})


def _info(files: dict[str, Path]) -> dict | None:
    """The entry's own record of its build, or None where it is missing or not what a build writes (an
    entry whose manifest was rewritten to match: it is built again, never a KeyError)."""
    try:
        info = json.loads(files["flashgen.json"].read_text(encoding="utf-8"))
    except (KeyError, OSError, ValueError):
        return None
    ok = (isinstance(info, dict) and isinstance(info.get("binary_symbol"), str) and isinstance(info.get("triton_hash"), str)
          and isinstance(info.get("shared_bytes"), int))
    return info if ok else None


def build(wl: Workload, schedule: Schedule, target: Target) -> Kernel:
    parts = staged.plan(wl, schedule, target)
    if parts is not None:
        return staged.kernel(wl, schedule, target, *(build(w, s, target) for w, s in parts))
    ks = for_target(generate(wl, schedule), target)
    key = cache_key(ks, wl, schedule, target)
    files = artifacts.lookup(key)
    info = _info(files) if files is not None else None
    if info is None:
        if files is not None:
            artifacts.discard(key, "has an unreadable flashgen.json")
        ck = compile_aot(ks, wl, schedule, target)
        group = {Path(p).name: Path(p).read_bytes() for p in ck.metadata_group.values()}
        info = {"binary_symbol": ck.metadata.name, "shared_bytes": ck.metadata.shared, "triton_hash": ck.hash,
                "global_scratch_bytes": getattr(ck.metadata, "global_scratch_size", 0)}
        files = artifacts.store(key, {**group, "flashgen.json": json.dumps(info).encode()})
    ck = load_compiled(ast_source(ks, wl), {n: str(p) for n, p in files.items() if n != "flashgen.json"},
                       info["triton_hash"])
    text_kind, bin_kind = ASM[target.triton_target[0]]
    asm = {text_kind: ck.asm[text_kind], "ttgir": ck.asm["ttgir"]}
    meta = {"kernel_name": ks.name, "binary_symbol": info["binary_symbol"], "backend": "triton",
            "num_warps": schedule["num_warps"], "shared_bytes": info["shared_bytes"], "cache_key": key,
            # per program: a launch provides grid x this many bytes of global scratch (TMA descriptors)
            "global_scratch_bytes": info.get("global_scratch_bytes", 0),
            "signature": [a.name for a in ks.args],
            "constexprs": {a.name: a.value for a in ks.args if a.kind == "constexpr"},
            "tools": {"triton": triton.__version__, "torch": torch.__version__}}
    return Kernel(workload=wl, target=target, schedule=schedule, name=ks.name, source=ks.source, asm=asm,
                  binary=ck.asm[bin_kind], binary_kind=bin_kind, metadata=meta,
                  launcher=TritonLauncher(ks, wl, target, ck), runnable=runnable_source(ks, wl, schedule, target))
