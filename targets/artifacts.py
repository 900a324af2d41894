"""On-disk cache of compiled kernels, so that a restarted tune, a second process or the runtime finds
a kernel built before instead of compiling it again.

An entry is a folder named by the sha256 of everything that decides the binary (generated source,
compile options, target architecture, tool versions), written to a temporary folder and renamed into
place, so a reader sees a whole entry or none and concurrent builders of one kernel do not clash. Its
manifest (MANIFEST: each file's sha256) is checked on every lookup: an entry with a missing, truncated,
changed or extra file, or a manifest that does not parse, is discarded with a one-line warning and
built again, so nothing in the cache is loaded or shipped that the build did not write.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping

from flashgen.errors import FlashgenError
from flashgen.paths import cache_dir, writable

MANIFEST = "MANIFEST"  # JSON {file name: sha256}, written last: its presence marks an entry whole


def artifact_key(parts: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def entry(key: str) -> Path:
    return cache_dir() / "kernels" / key[:2] / key


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _discard(folder: Path, why: str) -> None:
    warnings.warn(f"flashgen: cached kernel {folder} {why}; building it again", stacklevel=3)
    shutil.rmtree(folder, ignore_errors=True)


def _remove(path: Path) -> None:
    """Whatever lies where an entry goes: a damaged entry's folder, or a stray file (which rmtree leaves,
    so every later store of the kernel would fail)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def discard(key: str, why: str) -> None:
    """Drops an entry its reader found unusable, with the one-line warning."""
    _discard(entry(key), why)


def lookup(key: str) -> dict[str, Path] | None:
    """The entry's files by name, each checked against the manifest's sha256; None when the kernel was
    never built, or its entry was damaged (then discarded)."""
    folder = entry(key)
    if not folder.is_dir():
        return None
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:  # an entry of an older layout, or a damaged one
        _discard(folder, "has no manifest")
        return None
    except (OSError, ValueError):
        _discard(folder, "has an unreadable manifest")
        return None
    if not isinstance(manifest, dict) or not all(isinstance(v, str) for v in manifest.values()):
        _discard(folder, "has a malformed manifest")
        return None
    present = {p.name for p in folder.iterdir()} - {MANIFEST}
    if present != set(manifest):
        _discard(folder, "holds other files than its manifest lists")
        return None
    for name, digest in manifest.items():
        try:
            ok = _sha256((folder / name).read_bytes()) == digest
        except OSError:
            ok = False
        if not ok:
            _discard(folder, f"has a file ({name}) that does not match its recorded sha256")
            return None
    return {name: folder / name for name in manifest}


def store(key: str, files: Mapping[str, bytes]) -> dict[str, Path]:
    """Writes an entry whole (or keeps the one another process wrote first); returns its files."""
    folder = entry(key)
    try:
        stage = Path(tempfile.mkdtemp(prefix=f".{key[:8]}-", dir=writable(folder.parent)))
    except OSError as e:
        raise FlashgenError(f"cannot write the kernel cache {cache_dir()} ({e.strerror or e}); "
                            "set FLASHGEN_CACHE_DIR to a writable folder") from None
    try:
        for name, data in files.items():
            (stage / name).write_bytes(data)
        manifest = {name: _sha256(data) for name, data in files.items()}
        (stage / MANIFEST).write_text(json.dumps(manifest, sort_keys=True), encoding="utf-8")
        try:
            os.rename(stage, folder)
        except OSError:  # another process stored the same kernel first, or a damaged entry is in the way
            if lookup(key) is None:
                _remove(folder)
                os.rename(stage, folder)
    except OSError as e:
        raise FlashgenError(f"cannot write the kernel cache {cache_dir()} ({e.strerror or e}); "
                            "set FLASHGEN_CACHE_DIR to a writable folder") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    found = lookup(key)
    if found is None:
        raise FlashgenError(f"the kernel cache entry {folder} did not read back as written; "
                            "check the disk, or set FLASHGEN_CACHE_DIR to another folder")
    return found
