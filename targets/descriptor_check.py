"""A target descriptor checked as data: each field's type and range, with the file and field named.

What a vendor and architecture imply is filled in where a descriptor leaves it out, so a minimal file
(key, vendor, backend, arch, triton_target, warp_size, dtypes, devices) builds every kernel class:
integer index types (int32, int64) on any GPU, and per architecture the limits every GPU of it has
(threads per block and per SM, registers per SM, shared memory per block) from the vendor's tables.

Names become parts of target ids ("cuda:sm_90/h200"), records and file names, so they are plain words.
"""
from __future__ import annotations

import math
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from flashgen.errors import FlashgenError
from flashgen.ir import dtypes as D

VENDORS = {"nvidia": ("triton",), "amd": ("triton",), "cpu": ("tvm",)}
GPU_IMPLIED_DTYPES = ("int32", "int64")  # indices, block tables, packed words: every GPU computes them
# The architectures a descriptor may name are those the pinned Triton (3.6) builds every kernel class
# for, checked by compiling them ahead of time. Others fail late and badly: sm_10 aborts the process
# inside LLVM, ptxas refuses sm_110, and Triton supports NVIDIA from compute capability 8.0 on.
# Per NVIDIA architecture its limits (CUDA programming guide's tables):
NVIDIA_LIMITS = {  # compute capability -> (max threads per SM, shared memory per block in bytes)
    80: (2048, 166912), 86: (1536, 101376), 87: (1536, 166912), 89: (1536, 101376), 90: (2048, 232448),
    100: (2048, 232448), 103: (2048, 232448), 120: (1536, 101376), 121: (1536, 101376)}
AMD_WAVES = {  # CDNA and RDNA 3/4 -> wave size, which Triton takes from the arch (wave32 from gfx10 on)
    "gfx908": 64, "gfx90a": 64, "gfx942": 64, "gfx950": 64, "gfx1100": 32, "gfx1101": 32, "gfx1200": 32,
    "gfx1201": 32}
ARCHS: dict[str, dict[str, int]] = {  # vendor -> accepted arch -> its warp size
    "nvidia": {f"sm_{cc}": 32 for cc in NVIDIA_LIMITS}, "amd": AMD_WAVES, "cpu": {"llvm": 1}}
AMD_LDS = {"gfx950": 163840}  # bytes of LDS a workgroup may use; 64 KB on the others
# What a binary is built from: records and cached kernels are keyed by the architecture's key, so these
# stay as the file that defines the key says; an extending file or a device may not change them.
IDENTITY = ("vendor", "backend", "arch", "triton_target", "warp_size")
ARCH_ONLY = ("key", *IDENTITY, "dtypes")  # a Target reads these from the architecture, never a device
OPTIONAL_COUNTS = ("max_threads_per_block", "max_threads_per_sm", "regs_per_sm", "smem_per_block", "l2_bytes",
                   "clock_mhz")
DEVICE_FIELDS = ("sm_count", "mem_bandwidth_gbs", "measured_copy_gbs", "peak_tflops", "device_names",
                 *OPTIONAL_COUNTS)
# A field outside these is refused: a misspelt limit ("smem_per_blok") would otherwise leave the
# architecture's default in force without a word.
TOP_FIELDS = (*ARCH_ONLY, "devices", "extends", *DEVICE_FIELDS)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # a device name: no path separators, never "" or ".."
KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")  # an architecture key: a name, "vendor:arch" by convention
ARCH_NAME = re.compile(r"sm_[0-9]+|gfx[0-9a-f]+")  # what a key's last ":" part names when it names an arch


def _fail(path: Path, field: str, why: str) -> FlashgenError:
    return FlashgenError(f"target descriptor {path}: {field} {why}")


def _known(path: Path, where: str, d: dict[str, Any], fields: tuple[str, ...]) -> None:
    """Every field of `d` is one a reader reads (the closest known name is suggested)."""
    import difflib

    for field in d:
        if field not in fields:
            near = difflib.get_close_matches(str(field), fields, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f" (known: {', '.join(fields)})"
            raise _fail(path, f"{where}{field}", f"is not a descriptor field{hint}")


def _count(path: Path, field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _fail(path, field, f"must be a whole number >= {minimum}, got {value!r}")
    return value


def _rate(path: Path, field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise _fail(path, field, f"must be a positive number, got {value!r}")
    return float(value)


def _choice(path: Path, field: str, value: Any, choices: Collection[str], what: str = "") -> str:
    """`value` if it is one of `choices` (a JSON list or object given instead is refused, not hashed)."""
    if not isinstance(value, str) or value not in choices:
        raise _fail(path, field, f"{what}must be one of {', '.join(choices)}, got {value!r}")
    return value


def check_key(path: Path, key: Any) -> str:
    """The architecture's key, checked before anything is looked up by it (an extending file's too)."""
    if not isinstance(key, str) or not KEY.fullmatch(key):
        raise _fail(path, "key", f"must be a name such as 'cuda:sm_89' (letters, digits, . _ - :), got {key!r}")
    return key


def _key_arch(path: Path, spec: dict[str, Any]) -> None:
    """A key that names an arch ("cuda:sm_89") names the file's own: records and cached kernels are filed
    under the key, so "cuda:sm_89" over sm_86 builds would mix them with another install's true sm_89
    ones. A key naming no arch ("cuda:sm_90-lab", "cpu") is free: a different build needs its own key."""
    named = spec["key"].rpartition(":")[2]
    if ARCH_NAME.fullmatch(named) and named != spec["arch"]:
        raise _fail(path, "key", f"{spec['key']!r} names arch {named}, but the file's arch is {spec['arch']}; "
                    "make them agree, or give a key whose last part names no arch")


def _arch(path: Path, spec: dict[str, Any]) -> None:
    """The arch is one Triton (or TVM) builds for; triton_target and warp_size are what it implies,
    so a file can't name one GPU and build for another."""
    vendor, backend = spec["vendor"], spec["backend"]
    arch = _choice(path, "arch", spec["arch"], ARCHS[vendor], f"of {vendor} targets ")
    warp = spec["warp_size"]
    if isinstance(warp, bool) or warp != ARCHS[vendor][arch]:
        raise _fail(path, "warp_size", f"of {arch} must be {ARCHS[vendor][arch]}, got {warp!r}")
    if backend != "triton":
        return
    want = ["cuda", int(arch[3:])] if vendor == "nvidia" else ["hip", arch]
    tt = spec.get("triton_target")
    if not isinstance(tt, list) or tt != want or any(isinstance(v, bool) for v in tt):
        raise _fail(path, "triton_target", f"must be {want} for arch {arch}, got {tt!r}")


def _numbers(path: Path, where: str, d: dict[str, Any], least: int) -> None:
    """The numbers of a file's top level or of one device, where given: counts >= `least` (1 on a GPU;
    the CPU says 0 for what it lacks, such as shared memory), rates positive. bool is no number."""
    for field in ("sm_count", *OPTIONAL_COUNTS):
        if field in d:
            _count(path, where + field, d[field], least)
    for field in ("mem_bandwidth_gbs", "measured_copy_gbs"):
        if field in d:
            _rate(path, where + field, d[field])
    if "peak_tflops" in d:
        peaks = d["peak_tflops"]
        if not isinstance(peaks, dict) or not peaks:
            raise _fail(path, f"{where}peak_tflops", f"must map dtype names to TFLOP/s, got {peaks!r}")
        for name, value in peaks.items():
            if name not in D.TORCH and name != "tf32":
                raise _fail(path, f"{where}peak_tflops", f"names an unknown dtype {name!r}")
            _rate(path, f"{where}peak_tflops.{name}", value)


TWIN_RATES = {"fp16": "bf16", "bf16": "fp16"}  # 16-bit floats: one matrix rate on every GPU


def peak_rates(path: Path, where: str, peaks: dict[str, float], names: Collection[str], vendor: str
               ) -> tuple[dict[str, float], tuple[str, ...]]:
    """A device's peak rates with every rate the cost model reads: fp32's, and those of each listed
    float dtype and int8 (the operand dtypes of its kernels). A missing 16-bit float rate is its twin's
    (fp16 and bf16 run at one rate), a missing CPU rate its fp32 rate; both are derived and said so
    (the second value: "fp16 = bf16's"). Any other missing rate is an error naming it: a guess there
    would misrank every schedule of that dtype."""
    out, derived = dict(peaks), []
    for name in ["fp32"] + [n for n in names if n != "fp32" and (D.is_float(n) or n == "int8")]:
        if name in out:
            continue
        source = "fp32" if vendor == "cpu" else TWIN_RATES.get(name)
        if source not in peaks:
            raise _fail(path, f"{where}peak_tflops", f"lacks {name}: the cost model reads the peak rate of fp32 "
                        "and of each listed float dtype and int8; give it in TFLOP/s (TOP/s for int8)")
        out[name] = peaks[source]
        derived.append(f"{name} = {source}'s")
    return out, tuple(derived)


def implied(spec: dict[str, Any]) -> dict[str, Any]:
    """The fields a vendor and architecture imply, for those the file leaves out."""
    vendor, arch = spec["vendor"], spec["arch"]
    if vendor == "nvidia":
        threads_sm, smem = NVIDIA_LIMITS[int(arch[3:])]
        return {"max_threads_per_block": 1024, "max_threads_per_sm": threads_sm, "regs_per_sm": 65536,
                "smem_per_block": smem}
    if vendor == "amd":
        return {"max_threads_per_block": 1024, "max_threads_per_sm": 2048, "regs_per_sm": 131072,
                "smem_per_block": AMD_LDS.get(arch, 65536)}
    return {}


def check(path: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """The descriptor with implied fields filled in; a bad field is a FlashgenError naming it."""
    check_key(path, spec.get("key"))
    _known(path, "", spec, TOP_FIELDS)
    vendor = _choice(path, "vendor", spec["vendor"], VENDORS)
    _choice(path, "backend", spec["backend"], VENDORS[vendor], f"of {vendor} targets ")
    _arch(path, spec)
    _key_arch(path, spec)
    names = spec["dtypes"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _fail(path, "dtypes", f"must be a list of dtype names, got {names!r}")
    unknown = [n for n in names if n not in D.TORCH]
    if unknown:
        raise _fail(path, "dtypes", f"names unknown dtypes {', '.join(unknown)} (known: {', '.join(D.TORCH)})")
    out = {**implied(spec), **spec}
    if vendor != "cpu":
        out["dtypes"] = names + [n for n in GPU_IMPLIED_DTYPES if n not in names]
    least = 0 if vendor == "cpu" else 1
    _numbers(path, "", out, least)
    if not isinstance(spec["devices"], dict) or not spec["devices"]:
        raise _fail(path, "devices", "must name at least one device")
    for dev, d in spec["devices"].items():
        where = f"devices.{dev}"
        if not NAME.fullmatch(dev):
            raise _fail(path, f"device name {dev!r}", "must be letters, digits, '.', '_' or '-', starting with a "
                        "letter or digit (it becomes part of target ids and file names)")
        if not isinstance(d, dict):
            raise _fail(path, where, "must be a JSON object")
        missing = [f for f in ("sm_count", "mem_bandwidth_gbs", "peak_tflops") if f not in d]
        if missing:
            raise _fail(path, f"device {dev}", f"lacks {', '.join(missing)}")
        own = [f for f in ARCH_ONLY if f in d]
        if own:
            raise _fail(path, f"{where}.{own[0]}", "belongs to the architecture: set it at the top of the file "
                        "(a device's value would be ignored by some readers and used by others)")
        _known(path, where + ".", {f: v for f, v in d.items() if f not in ARCH_ONLY}, DEVICE_FIELDS)
        _numbers(path, where + ".", d, least)
        names_ = d.get("device_names", [])
        if not isinstance(names_, list) or not all(isinstance(n, str) and n for n in names_):
            raise _fail(path, f"{where}.device_names", f"must be a list of names, got {names_!r}")
    return out


def extend(path: Path, base: dict[str, Any], spec: dict[str, Any], origin: Path) -> dict[str, Any]:
    """`base` (the checked architecture `origin` defines) with an extending file's fields over it, checked
    as one descriptor: the file adds devices (or replaces one of the same name) and may override the
    architecture's numbers, but not what a binary is built from (IDENTITY), or one key would name two
    different builds."""
    for field in IDENTITY:
        if field in spec and spec[field] != base.get(field):
            raise _fail(path, field, f"may not change in a file that extends {base['key']} ({origin} has "
                        f"{base.get(field)!r}, this file {spec[field]!r}); give a different build its own key")
    devices = spec.get("devices", {})
    if not isinstance(devices, dict):
        raise _fail(path, "devices", f"must be a JSON object of devices, got {devices!r}")
    over = {k: v for k, v in spec.items() if k != "extends"}
    return check(path, {**base, **over, "devices": {**base["devices"], **devices}})
