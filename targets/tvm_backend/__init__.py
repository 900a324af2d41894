"""TVM backend for the `cpu` target: IR -> TVMScript -> LLVM -> a shared library, run on torch CPU tensors.

`build(wl, schedule, target)` returns a Kernel whose source is the generated TVMScript (lower.py),
whose binary is the linked .so (llvm.py) and whose launcher calls that very library (launch.py); the
launcher also has `.time(tensors, params, dims, number=, repeat=)` for measurement. A saved kernel
(its metadata JSON and .so bytes) gets a launcher again through `launcher_from_binary`.

Builds are kept in the artifact cache (targets/artifacts.py) under a key of the TVMScript that TVM
parses, the LLVM target string, TVM's version and flashgen's: a kernel built before is loaded from its
cached .so without importing tvm (runtime.py), so a warm start compiles nothing and spends no time on
the compiler's imports: a second `flashgen generate` of a tiny Llama on 2 cores prints its first token
after 1.9-2.7 s, against 4.5-4.7 s when every run built its kernels.

Threads: rows run on TVM's thread pool: $TVM_NUM_THREADS threads, else $OMP_NUM_THREADS, else half the
logical CPUs on x86 (TVM assumes hyper-threading: 1 thread on a 2-vCPU machine). Start the pool in the
process that runs kernels: a child fork()ed after its parent ran a parallel kernel hangs in its first
parallel kernel (checked with TVM_NUM_THREADS=2); measure in spawned workers.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

import torch

from flashgen import __version__
from flashgen.errors import FlashgenError
from flashgen.kernel_classes import generator
from flashgen.targets import artifacts
from flashgen.targets.descriptor import Target
from flashgen.targets.kernel import Kernel
from flashgen.targets.tvm_backend.launch import TVMLauncher
from flashgen.targets.tvm_backend.lower import TVMArg, TVMSource
from flashgen.targets.tvm_backend.runtime import llvm_spec, load_library, tvm_version
from flashgen.workload import Schedule, Workload

__all__ = ["build", "launcher_from_binary", "TVMLauncher"]

RECORD = "flashgen.json"  # an entry's record of its build: entry, signature, LLVM target, tool versions
ASM = ("llvm", "s")


def cache_key(ks: TVMSource, llvm: dict[str, str]) -> str:
    """Everything the build reads: the script TVM parses (the source less its comment header), the
    LLVM target and the versions of TVM and flashgen."""
    return artifacts.artifact_key({"script": ks.script, "llvm_target": llvm, "tvm": tvm_version(),
                                   "flashgen": __version__})


def _compile(ks: TVMSource, llvm: dict[str, str]) -> dict[str, bytes]:
    """The entry's files: the .so, its source, LLVM IR and assembly, and the build's record."""
    from tvm.target import codegen

    from flashgen.targets.tvm_backend.llvm import artifacts as asm_texts, compile_module, export, llvm_target

    target = llvm_target(llvm)
    ex = compile_module(ks, target)
    record = {"entry": ks.name, "signature": [a.to_json() for a in ks.args], "llvm_target": str(target),
              "tools": {"tvm": tvm_version(), "llvm": codegen.llvm_version_major(), "torch": torch.__version__}}
    files = {f"{ks.name}.so": export(ex, ks.name), f"{ks.name}.tvm.py": ks.source.encode(),
             RECORD: json.dumps(record, sort_keys=True).encode()}
    files.update({f"{ks.name}.{kind}": text.encode() for kind, text in asm_texts(ex).items()})
    return files


def _record(files: Mapping[str, Path], ks: TVMSource) -> dict | None:
    """The entry's record when it is the one this kernel's build writes, else None (a damaged entry
    whose manifest was rewritten to match: built again, never a KeyError)."""
    try:
        record = json.loads(files[RECORD].read_text(encoding="utf-8"))
    except (KeyError, OSError, ValueError):
        return None
    ok = (isinstance(record, dict) and record.get("entry") == ks.name and f"{ks.name}.so" in files
          and record.get("signature") == [a.to_json() for a in ks.args]
          and isinstance(record.get("llvm_target"), str) and isinstance(record.get("tools"), dict))
    return record if ok else None


def build(wl: Workload, schedule: Schedule, target: Target) -> Kernel:
    if target.backend != "tvm":
        raise ValueError(f"the tvm backend cannot build for {target.key} (backend {target.backend})")
    ks: TVMSource = generator(wl.op.kclass, "tvm")(wl, schedule)
    llvm = llvm_spec()
    key = cache_key(ks, llvm)
    files = artifacts.lookup(key)
    record = _record(files, ks) if files is not None else None
    if record is None:
        if files is not None:
            artifacts.discard(key, f"has an unreadable {RECORD}")
        files = artifacts.store(key, _compile(ks, llvm))
        record = _record(files, ks)
    binary = files[f"{ks.name}.so"].read_bytes()
    asm = {kind: files[f"{ks.name}.{kind}"].read_text(encoding="utf-8")
           for kind in ASM if f"{ks.name}.{kind}" in files}
    meta = {"kernel_name": ks.name, "entry": ks.name, "backend": "tvm", "llvm_target": record["llvm_target"],
            "signature": record["signature"], "row_dims": list(wl.op.row_dims), "params": dict(wl.op.params),
            "notes": "bf16 tensors are passed as uint16 bits; row dims are read off the tensors' shapes",
            "cache_key": key, "tools": record["tools"]}
    return Kernel(workload=wl, target=target, schedule=schedule, name=ks.name, source=ks.source, asm=asm,
                  binary=binary, binary_kind="so", metadata=meta,
                  launcher=TVMLauncher(wl, ks.args, load_library(binary, ks.name), ks.name))


def launcher_from_binary(wl: Workload, metadata: Mapping[str, Any], binary: bytes) -> TVMLauncher:
    """A launcher for a saved kernel: its metadata JSON and the bytes of its .so. A JSON that is not one
    `Kernel.save` wrote for `wl` (another workload's: its dims are compiled in; one without the .so's
    sha256: nothing then says the binary is whole), a binary that is not the one its JSON records, or
    one built by another TVM (whose calling convention it has), is refused in one line."""
    entry = metadata.get("entry") if isinstance(metadata, Mapping) else None
    if not isinstance(entry, str) or not entry:
        raise FlashgenError("the kernel JSON names no entry: it is not one `flashgen compile` wrote")
    compiled = _compiled_in(metadata.get("workload"), wl)
    if compiled is None:
        raise FlashgenError(f"the kernel JSON of {entry} records no workload: it is not one `flashgen compile` wrote")
    if compiled != _compiled_in(wl.to_json(), wl):
        raise FlashgenError(f"the kernel {entry} was compiled for {json.dumps(metadata['workload'], sort_keys=True)}, "
                            f"not for {wl}")
    digests = metadata.get("sha256")
    digest = digests.get(f"{entry}.so") if isinstance(digests, Mapping) else None
    if not isinstance(digest, str):
        raise FlashgenError(f"the kernel JSON records no sha256 of {entry}.so, so nothing says the binary is "
                            "whole: compile it again")
    if hashlib.sha256(binary).hexdigest() != digest:
        raise FlashgenError(f"{entry}.so does not match the sha256 its JSON records: "
                            "it was changed or cut short since it was written")
    tools = metadata.get("tools")
    built = tools.get("tvm") if isinstance(tools, Mapping) else None
    if built != tvm_version():
        raise FlashgenError(f"this kernel was built by TVM {built}, and this is TVM {tvm_version()}: "
                            "compile it again with this installation")
    try:
        args = [TVMArg(**a) for a in metadata["signature"]]
    except (KeyError, TypeError) as e:
        raise FlashgenError(f"the kernel JSON's signature of {entry} is malformed ({e})") from None
    return TVMLauncher(wl, args, load_library(binary, entry), entry)


def _compiled_in(form: Any, wl: Workload) -> Any:
    """What of a workload's JSON a kernel has compiled in: its op, attrs and dims less the row dims (read
    off the tensors at each call), so that a kernel is loaded for any row count and no other workload."""
    if not isinstance(form, Mapping) or not isinstance(form.get("dims"), Mapping):
        return None
    return {"op": form.get("op"), "attrs": form.get("attrs"),
            "dims": {k: v for k, v in form["dims"].items() if k not in wl.op.row_dims}}
