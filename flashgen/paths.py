"""Where flashgen keeps its files: $FLASHGEN_CACHE_DIR, else $XDG_CACHE_HOME/flashgen (~/.cache)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("FLASHGEN_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flashgen"
