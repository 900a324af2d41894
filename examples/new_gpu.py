"""Kernels for a GPU that flashgen has no descriptor for, from Python, on a machine without that GPU.

A new NVIDIA or AMD part of a known architecture needs only a descriptor (its SM count, bandwidth and
peak rates): the schedule spaces' rules and the analytic defaults read them, and the Triton backend
builds for its architecture. This script describes an L40S (sm_89), builds a decoder's ops for it
ahead of time, and checks the same ops' numerics on the CPU with the `cpu` target's TVM kernels.

    python examples/new_gpu.py [--out OUT_DIR]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import flashgen
from flashgen.check import check
from flashgen.targets import get_target

L40S = {"key": "cuda:sm_89", "vendor": "nvidia", "backend": "triton", "arch": "sm_89",
        "triton_target": ["cuda", 89], "warp_size": 32, "max_threads_per_block": 1024,
        "max_threads_per_sm": 1536, "regs_per_sm": 65536, "smem_per_block": 101376,
        "dtypes": ["fp32", "fp16", "bf16", "int8", "int32", "int64"],
        "devices": {"l40s": {"device_names": ["NVIDIA L40S"], "sm_count": 142, "clock_mhz": 2520,
                             "l2_bytes": 100663296, "mem_bandwidth_gbs": 864,
                             "peak_tflops": {"fp32": 91.6, "fp16": 181, "bf16": 181, "int8": 362}}}}

# One decoder layer's small ops at a decode step of 8 sequences (Llama-3-8B widths).
WORKLOADS = [
    flashgen.workload("rmsnorm", M=8, N=4096, dtype="bf16"),
    flashgen.workload("rope_cache", M=8, Hq=32, Hkv=8, D=128, L=8192, NS=4096, dtype="bf16"),
    flashgen.workload("silu_mul", M=8, N=14336, dtype="bf16"),
    flashgen.workload("gemm", M=8, N=6144, K=4096, dtype="bf16"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for each kernel's files (default: none written)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "l40s.json").write_text(json.dumps(L40S))
        target = get_target("l40s", [tmp])
        print(f"target {target.id}: {target.sm_count} SMs, {target.get('mem_bandwidth_gbs')} GB/s")
        for wl in WORKLOADS:
            k = flashgen.compile(wl, target)
            print(f"  {wl.op_name:11s} {k.binary_kind} {len(k.binary):6d} bytes, schedule {k.schedule}")
            assert f".target {target.arch}" in k.asm["ptx"]
            if args.out:
                k.save(args.out / wl.op_name)
    for wl in WORKLOADS[:3]:  # the same descriptions as CPU kernels, against the float64 reference
        cpu = flashgen.compile(wl.with_dims(M=3) if "NS" not in wl.dim else wl.with_dims(M=3, NS=64), "cpu")
        bad = [c for c in check(cpu.workload, lambda i, o, p: cpu.run(i, o, p), seed=0) if not c.ok]
        print(f"  {wl.op_name:11s} cpu numerics {'ok' if not bad else bad}")
        assert not bad


if __name__ == "__main__":
    main()
