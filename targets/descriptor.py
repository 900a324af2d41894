"""Target descriptors: data files that say what a GPU (or the CPU) is, so adding one needs no code.

A descriptor file holds one architecture (`key` such as "cuda:sm_90") and the devices built on it
(h100, h200), whose numbers (SMs, bandwidth, peak rates) override the architecture's. Files come from
this package's `descriptors/` folder, then from each folder in $FLASHGEN_TARGETS_PATH (os.pathsep
separated) and any folders passed in. Each file is checked as data (descriptor_check.py). A file whose
key another file already defines is refused, unless it says `"extends": true`: then its fields override
that architecture's and its devices are added to (or replace, by name) the devices it had; what the
architecture's binaries are built from (vendor, backend, arch, triton_target, warp_size) stays.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from flashgen.errors import FlashgenError
from flashgen.targets import descriptor_check

BUILTIN = Path(__file__).with_name("descriptors")
REQUIRED = ("key", "vendor", "backend", "arch", "warp_size", "dtypes", "devices")
BACKENDS = ("triton", "tvm")


@dataclass(frozen=True)
class Target:
    key: str                 # architecture: what a binary is built for ("cuda:sm_90")
    device: str              # the device whose numbers these are ("h200")
    vendor: str
    backend: str
    arch: str
    warp_size: int
    dtypes: tuple[str, ...]
    sm_count: int
    mem_bandwidth_gbs: float
    peak_tflops: dict[str, float]  # every rate the cost model reads (descriptor_check.peak_rates)
    aliases: tuple[str, ...]
    spec: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    derived: tuple[str, ...] = ()  # peak rates the file leaves out, derived from another ("fp16 = bf16's")

    @property
    def id(self) -> str:
        """What the database keys tuning records by: the best schedule depends on the device."""
        return f"{self.key}/{self.device}"

    @property
    def copy_gbs(self) -> float:
        """Bandwidth a memory-bound kernel can reach: measured copy rate where known, else the datasheet's."""
        return float(self.spec.get("measured_copy_gbs", self.mem_bandwidth_gbs))

    @property
    def capability(self) -> int:
        """The NVIDIA compute capability as a number (90 for sm_90), 0 for other vendors."""
        return int(self.arch.removeprefix("sm_")) if self.vendor == "nvidia" and self.arch.startswith("sm_") else 0

    @property
    def pdl(self) -> bool:
        """Whether kernels can launch while the previous one runs and wait for it in-kernel (programmatic
        dependent launch, griddepcontrol: NVIDIA sm_90 and later)."""
        return self.capability >= 90

    @property
    def triton_target(self) -> tuple[str, Any]:
        return tuple(self.spec["triton_target"])  # type: ignore[return-value]

    def get(self, name: str, default: Any = None) -> Any:
        return self.spec.get(name, default)


def _search_dirs(extra: Iterable[str | os.PathLike] = ()) -> list[Path]:
    env = [p for p in os.environ.get("FLASHGEN_TARGETS_PATH", "").split(os.pathsep) if p]
    return [BUILTIN, *map(Path, env), *map(Path, extra)]


def _read(path: Path) -> dict[str, Any]:
    """One file as JSON, checked alone; an extending file is checked once merged with what it extends."""
    try:  # utf-8-sig: a BOM that an editor wrote is no reason to refuse a file
        spec = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError) as e:  # ValueError: not JSON, or bytes that are not UTF-8
        raise FlashgenError(f"target descriptor {path} is unreadable: {e}") from None
    if not isinstance(spec, dict):
        raise FlashgenError(f"target descriptor {path} must hold a JSON object")
    if not isinstance(spec.get("extends", False), bool):
        raise FlashgenError(f"target descriptor {path}: extends must be true or false (the file's key names "
                            f"the architecture it extends), got {spec['extends']!r}")
    descriptor_check.check_key(path, spec.get("key"))  # what an extending file is looked up by
    if spec.get("extends"):
        return spec
    missing = [k for k in REQUIRED if k not in spec]
    if missing:
        raise FlashgenError(f"target descriptor {path} lacks {', '.join(missing)}")
    if spec["backend"] not in BACKENDS:
        raise FlashgenError(f"target descriptor {path}: backend must be one of {', '.join(BACKENDS)}")
    if spec["backend"] == "triton" and "triton_target" not in spec:
        raise FlashgenError(f"target descriptor {path}: a triton target needs triton_target")
    return descriptor_check.check(path, spec)


def _not_a_folder(d: Path) -> FlashgenError:
    """Why a named target folder can't be read: a file given for the folder is told apart from a typo."""
    if d.exists():
        return FlashgenError(f"target folder {d} is a file, not a folder; name the folder that holds descriptor files")
    return FlashgenError(f"target folder {d} does not exist")


def load_targets(extra_dirs: Iterable[str | os.PathLike] = ()) -> dict[str, Target]:
    """Every device of every descriptor, by target id; each also answers to its aliases."""
    archs: dict[str, dict[str, Any]] = {}
    origin: dict[str, Path] = {}
    for d in _search_dirs(extra_dirs):
        if not d.is_dir():
            if d != BUILTIN:
                raise _not_a_folder(d)
            continue
        for path in sorted(d.glob("*.json")):
            spec = _read(path)
            key = spec.get("key")
            if spec.get("extends"):
                if key not in archs:
                    raise FlashgenError(f"target descriptor {path} extends {key!r}, which no earlier file defines "
                                        f"(defined: {', '.join(archs)})")
                spec = descriptor_check.extend(path, archs[key], spec, origin[key])
            elif key in archs:
                raise FlashgenError(f"target descriptor {path} defines {key!r}, which {origin[key]} defines "
                                    "already; give it another key, or add \"extends\": true to add devices to it")
            archs[key], origin[key] = spec, path
    out: dict[str, Target] = {}
    for key, spec in archs.items():
        for i, (dev, over) in enumerate(spec["devices"].items()):
            merged = {**{k: v for k, v in spec.items() if k != "devices"}, **over}
            peaks, derived = descriptor_check.peak_rates(origin[key], f"devices.{dev}.", merged["peak_tflops"],
                                                         spec["dtypes"], spec["vendor"])
            aliases = (dev, spec["arch"], key) if i == 0 else (dev,)
            t = Target(key=key, device=dev, vendor=spec["vendor"], backend=spec["backend"],
                       arch=spec["arch"], warp_size=int(spec["warp_size"]), dtypes=tuple(spec["dtypes"]),
                       sm_count=int(merged["sm_count"]), mem_bandwidth_gbs=float(merged["mem_bandwidth_gbs"]),
                       peak_tflops=peaks, aliases=aliases, spec=merged, derived=derived)
            out[t.id] = t
    return out


def get_target(name: str, extra_dirs: Iterable[str | os.PathLike] = ()) -> Target:
    """Resolve a target id ("cuda:sm_90/h200"), an architecture ("cuda:sm_90", "sm_90": its first
    device) or a device name ("h200", "mi300x")."""
    targets = load_targets(extra_dirs)
    if name in targets:
        return targets[name]
    for t in targets.values():
        if name.lower() in (a.lower() for a in t.aliases):
            return t
    names = sorted({a for t in targets.values() for a in (t.key, t.device)})
    raise FlashgenError(f"unknown target '{name}'; valid targets: {', '.join(names)}")


def siblings(target: Target) -> list[Target]:
    """The other devices of `target`'s architecture (h200 for h100): a binary built for one runs on
    the others, and a schedule tuned on one is valid there."""
    return [t for t in load_targets().values() if t.key == target.key and t.device != target.device]


def target_for_device(device_name: str, arch: str) -> Target:
    """The descriptor of a running GPU: by its marketing name, else the first device of its arch."""
    targets = load_targets()
    for t in targets.values():
        if any(device_name.startswith(n) for n in t.get("device_names", ())):
            return t
    for t in targets.values():
        if t.arch == arch:
            return t
    raise FlashgenError(f"no target descriptor for {device_name} ({arch}); add one (see `flashgen targets`)")
