"""A target descriptor checked as data: each field's type and range, with the file and field named.

What a vendor and architecture imply is filled in where a descriptor leaves it out, so a minimal file
(key, vendor, backend, arch, triton_target, warp_size, dtypes, devices) builds every kernel class:
integer index types (int32, int64) on any GPU, and per architecture the limits every GPU of it has
(threads per block and per SM, registers per SM, shared memory per block) from the vendor's tables.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from flashgen.errors import FlashgenError
from flashgen.ir import dtypes as D

VENDORS = {"nvidia": ("triton",), "amd": ("triton",), "cpu": ("tvm",)}
WARP_SIZES = {"nvidia": (32,), "amd": (64, 32), "cpu": (1,)}
GPU_IMPLIED_DTYPES = ("int32", "int64")  # indices, block tables, packed words: every GPU computes them
# Per-architecture limits (NVIDIA CUDA programming guide's tables; AMD CDNA/RDNA ISA documents).
NVIDIA_LIMITS = {  # compute capability -> (max threads per SM, shared memory per block in bytes)
    70: (2048, 98304), 75: (1024, 65536), 80: (2048, 166912), 86: (1536, 101376), 87: (1536, 166912),
    89: (1536, 101376), 90: (2048, 232448), 100: (2048, 232448), 120: (1536, 101376)}
AMD_LDS = {"gfx950": 163840}  # bytes of LDS a workgroup may use; 64 KB on the others
OPTIONAL_COUNTS = ("max_threads_per_block", "max_threads_per_sm", "regs_per_sm", "smem_per_block", "l2_bytes",
                   "clock_mhz")


def _fail(path: Path, field: str, why: str) -> FlashgenError:
    return FlashgenError(f"target descriptor {path}: {field} {why}")


def _count(path: Path, field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, field, f"must be a whole number >= {minimum}, got {value!r}")
    return value


def _rate(path: Path, field: str, value: Any, positive: bool) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
        and (value > 0 if positive else value >= 0)
    if not ok:
        raise _fail(path, field, f"must be a {'positive' if positive else 'non-negative'} number, got {value!r}")
    return float(value)


def _arch(path: Path, spec: dict[str, Any]) -> None:
    vendor, arch, backend = spec["vendor"], spec["arch"], spec["backend"]
    if not isinstance(arch, str) or not arch:
        raise _fail(path, "arch", f"must be a name such as sm_90 or gfx942, got {arch!r}")
    if vendor == "nvidia" and not re.fullmatch(r"sm_\d{2,3}a?", arch):
        raise _fail(path, "arch", f"of an nvidia target must read sm_NN, got {arch!r}")
    if vendor == "amd" and not re.fullmatch(r"gfx[0-9a-f]{3,4}", arch):
        raise _fail(path, "arch", f"of an amd target must read gfxNNN, got {arch!r}")
    if backend != "triton":
        return
    tt = spec.get("triton_target")
    want = ("cuda", int(arch[3:].rstrip("a"))) if vendor == "nvidia" else ("hip", arch)
    if not isinstance(tt, list) or len(tt) != 2 or tt[0] != want[0] or isinstance(tt[1], bool) \
            or not isinstance(tt[1], type(want[1])):
        raise _fail(path, "triton_target", f"must be [{want[0]!r}, {'a compute capability' if vendor == 'nvidia' else 'a gfx name'}] "
                    f"such as {list(want)}, got {tt!r}")


def implied(spec: dict[str, Any]) -> dict[str, Any]:
    """The fields a vendor and architecture imply, for those the file leaves out."""
    vendor, arch = spec["vendor"], spec["arch"]
    if vendor == "nvidia":
        cc = int(spec["triton_target"][1]) if isinstance(spec.get("triton_target"), list) else 0
        known = max((c for c in NVIDIA_LIMITS if c <= cc), default=None)
        threads_sm, smem = NVIDIA_LIMITS[known] if known is not None else (None, None)
        return {k: v for k, v in {"max_threads_per_block": 1024, "max_threads_per_sm": threads_sm,
                                  "regs_per_sm": 65536, "smem_per_block": smem}.items() if v is not None}
    if vendor == "amd":
        return {"max_threads_per_block": 1024, "max_threads_per_sm": 2048, "regs_per_sm": 131072,
                "smem_per_block": AMD_LDS.get(arch, 65536)}
    return {}


def check(path: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """The descriptor with implied fields filled in; a bad field is a FlashgenError naming it."""
    if not isinstance(spec.get("key"), str) or not spec["key"]:
        raise _fail(path, "key", f"must be a non-empty name such as 'cuda:sm_89', got {spec.get('key')!r}")
    vendor = spec["vendor"]
    if vendor not in VENDORS:
        raise _fail(path, "vendor", f"must be one of {', '.join(VENDORS)}, got {vendor!r}")
    if spec["backend"] not in VENDORS[vendor]:
        raise _fail(path, "backend", f"of a {vendor} target must be {' or '.join(VENDORS[vendor])}, "
                    f"got {spec['backend']!r}")
    _arch(path, spec)
    if spec["warp_size"] not in WARP_SIZES[vendor] or isinstance(spec["warp_size"], bool):
        raise _fail(path, "warp_size", f"of a {vendor} target must be {' or '.join(map(str, WARP_SIZES[vendor]))}, "
                    f"got {spec['warp_size']!r}")
    names = spec["dtypes"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _fail(path, "dtypes", f"must be a list of dtype names, got {names!r}")
    unknown = [n for n in names if n not in D.TORCH]
    if unknown:
        raise _fail(path, "dtypes", f"names unknown dtypes {', '.join(unknown)} (known: {', '.join(D.TORCH)})")
    out = {**implied(spec), **spec}
    if vendor != "cpu":
        out["dtypes"] = names + [n for n in GPU_IMPLIED_DTYPES if n not in names]
    for field in OPTIONAL_COUNTS:
        if field in out:
            _count(path, field, out[field], 0)
    if not isinstance(spec["devices"], dict) or not spec["devices"]:
        raise _fail(path, "devices", "must name at least one device")
    for dev, d in spec["devices"].items():
        where = f"devices.{dev}"
        if not isinstance(d, dict):
            raise _fail(path, where, "must be a JSON object")
        for field in ("sm_count", "mem_bandwidth_gbs", "peak_tflops"):
            if field not in d:
                raise _fail(path, f"device {dev}", f"lacks {field}")
        _count(path, f"{where}.sm_count", d["sm_count"], 1 if vendor != "cpu" else 0)
        _rate(path, f"{where}.mem_bandwidth_gbs", d["mem_bandwidth_gbs"], True)
        if "measured_copy_gbs" in d:
            _rate(path, f"{where}.measured_copy_gbs", d["measured_copy_gbs"], True)
        for field in OPTIONAL_COUNTS:
            if field in d:
                _count(path, f"{where}.{field}", d[field], 0)
        peaks = d["peak_tflops"]
        if not isinstance(peaks, dict) or not peaks:
            raise _fail(path, f"{where}.peak_tflops", f"must map dtype names to TFLOP/s, got {peaks!r}")
        for name, value in peaks.items():
            if name not in D.TORCH and name != "tf32":
                raise _fail(path, f"{where}.peak_tflops", f"names an unknown dtype {name!r}")
            _rate(path, f"{where}.peak_tflops.{name}", value, True)
        names_ = d.get("device_names", [])
        if not isinstance(names_, list) or not all(isinstance(n, str) and n for n in names_):
            raise _fail(path, f"{where}.device_names", f"must be a list of names, got {names_!r}")
    return out
