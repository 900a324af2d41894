"""On-disk cache of compiled kernels, so that a restarted tune, a second process or the runtime finds
a kernel built before instead of compiling it again.

An entry is a folder named by the sha256 of everything that decides the binary (generated source,
compile options, target architecture, tool versions), written to a temporary folder and renamed into
place, so a reader sees a whole entry or none and concurrent builders of one kernel do not clash.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

from flashgen.paths import cache_dir


def artifact_key(parts: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def entry(key: str) -> Path:
    return cache_dir() / "kernels" / key[:2] / key


def lookup(key: str) -> dict[str, Path] | None:
    """The entry's files by name, or None when the kernel was never built."""
    folder = entry(key)
    if not (folder / "COMPLETE").exists():
        return None
    return {p.name: p for p in folder.iterdir() if p.name != "COMPLETE"}


def store(key: str, files: Mapping[str, bytes]) -> dict[str, Path]:
    folder = entry(key)
    folder.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{key[:8]}-", dir=folder.parent))
    try:
        for name, data in files.items():
            (stage / name).write_bytes(data)
        (stage / "COMPLETE").write_text("")
        try:
            os.rename(stage, folder)
        except OSError:  # another process stored the same kernel first: theirs is as good
            if not (folder / "COMPLETE").exists():
                raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    found = lookup(key)
    assert found is not None
    return found
