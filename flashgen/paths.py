"""Where flashgen keeps its files: $FLASHGEN_CACHE_DIR, else $XDG_CACHE_HOME/flashgen (~/.cache)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("FLASHGEN_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashgen"


def writable(folder: Path) -> Path:
    """`folder` (under the cache), created if need be; a cache that cannot be written is one line that
    names the variable to change."""
    from flashgen.errors import FlashgenError

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FlashgenError(f"cannot write the cache folder {folder} ({e.strerror or e}); "
                            "set FLASHGEN_CACHE_DIR to a writable folder") from None
    return folder


def out_folder(path: str, option: str = "--out") -> Path:
    """An output folder path the OS can hold (each name and the whole path within its limits), and not
    an existing file, below a folder it can be written in; checked before any work, so that a long
    compile does not end in an OSError."""
    from flashgen.errors import FlashgenError

    out = Path(path)
    anchor = next((p for p in [out.absolute(), *out.absolute().parents] if _exists(p)), Path("/"))
    name_max, path_max = os.pathconf(anchor, "PC_NAME_MAX"), os.pathconf(anchor, "PC_PATH_MAX")
    longest = max(out.absolute().parts, key=lambda n: len(os.fsencode(n)))
    if len(os.fsencode(longest)) > name_max - 16:  # room for the staging folder's name
        raise FlashgenError(f"{option}: a folder name of {len(os.fsencode(longest))} bytes is over this file "
                            f"system's limit of {name_max}")
    if len(os.fsencode(str(out.absolute()))) > path_max - name_max:  # room for the files inside
        raise FlashgenError(f"{option}: the path is {len(os.fsencode(str(out.absolute())))} bytes, too long for "
                            f"files inside it (the limit is {path_max})")
    if _exists(out) and not out.is_dir():
        raise FlashgenError(f"{option} {out} exists and is not a folder")
    if not anchor.is_dir():  # (a file on the way: the folder cannot be made)
        raise FlashgenError(f"{option} {out}: {anchor} is a file, not a folder")
    if not os.access(anchor, os.W_OK | os.X_OK):  # (read-only: the compile would be lost)
        raise FlashgenError(f"{option} {out}: the folder {anchor} is not writable")
    return out


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except OSError:
        return False
