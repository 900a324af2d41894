"""TVM backend for the `cpu` target: IR -> TVMScript -> LLVM -> a shared library, run on torch CPU tensors.

`build(wl, schedule, target)` returns a Kernel whose source is the generated TVMScript (lower.py),
whose binary is the linked .so (build.py) and whose launcher calls that very library (launch.py); the
launcher also has `.time(tensors, params, dims, number=, repeat=)` for measurement. A saved kernel
(its metadata JSON and .so bytes) gets a launcher again through `launcher_from_binary`.

Threads: rows run on TVM's thread pool: $TVM_NUM_THREADS threads, else $OMP_NUM_THREADS, else half the
logical CPUs on x86 (TVM assumes hyper-threading: 1 thread on a 2-vCPU machine). Start the pool in the
process that runs kernels: a child fork()ed after its parent ran a parallel kernel hangs in its first
parallel kernel (checked with TVM_NUM_THREADS=2); measure in spawned workers.
"""
from __future__ import annotations

import hashlib

from typing import Any, Mapping

import torch
import tvm
from tvm.target import codegen

from flashgen.errors import FlashgenError
from flashgen.kernel_classes import generator
from flashgen.targets.descriptor import Target
from flashgen.targets.kernel import Kernel
from flashgen.targets.tvm_backend.build import artifacts, compile_module, export, llvm_target, load_library
from flashgen.targets.tvm_backend.launch import TVMLauncher
from flashgen.targets.tvm_backend.lower import Arg, KernelSource
from flashgen.workload import Schedule, Workload

__all__ = ["build", "launcher_from_binary", "TVMLauncher"]


def build(wl: Workload, schedule: Schedule, target: Target) -> Kernel:
    if target.backend != "tvm":
        raise ValueError(f"the tvm backend cannot build for {target.key} (backend {target.backend})")
    ks: KernelSource = generator(wl.op.kclass, "tvm")(wl, schedule)
    llvm = llvm_target()
    ex = compile_module(ks, llvm)
    asm = artifacts(ex)
    binary, lib = export(ex, ks.name)
    meta = {"kernel_name": ks.name, "entry": ks.name, "backend": "tvm", "llvm_target": str(llvm),
            "signature": [a.to_json() for a in ks.args],
            "row_dims": list(wl.op.row_dims), "params": dict(wl.op.params),
            "notes": "bf16 tensors are passed as uint16 bits; row dims are read off the tensors' shapes",
            "tools": {"tvm": tvm.__version__, "llvm": codegen.llvm_version_major(),
                      "torch": torch.__version__}}
    return Kernel(workload=wl, target=target, schedule=schedule, name=ks.name, source=ks.source, asm=asm,
                  binary=binary, binary_kind="so", metadata=meta,
                  launcher=TVMLauncher(wl, ks.args, lib, ks.name))


def launcher_from_binary(wl: Workload, metadata: Mapping[str, Any], binary: bytes) -> TVMLauncher:
    """A launcher for a saved kernel: its metadata JSON and the bytes of its .so. A binary that is not
    the one its JSON records, or one built by another TVM (whose calling convention it has), is refused."""
    digest = metadata.get("sha256", {}).get(f"{metadata['entry']}.so")
    if digest is not None and hashlib.sha256(binary).hexdigest() != digest:
        raise FlashgenError(f"{metadata['entry']}.so does not match the sha256 its JSON records: "
                            "it was changed or cut short since it was written")
    built = metadata.get("tools", {}).get("tvm")
    if built != tvm.__version__:
        raise FlashgenError(f"this kernel was built by TVM {built}, and this is TVM {tvm.__version__}: "
                            "compile it again with this installation")
    args = [Arg(**a) for a in metadata["signature"]]
    return TVMLauncher(wl, args, load_library(binary, metadata["entry"]), metadata["entry"])
