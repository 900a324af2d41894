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
