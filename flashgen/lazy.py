"""Modules imported on first use: the commands that compute nothing (`--help`, `ops`, `targets`, `db`)
start without loading torch, which alone takes longer than they should."""
from __future__ import annotations

import importlib
import types
from typing import Any


class _LazyModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attr)


def lazy(name: str) -> Any:
    """A stand-in for module `name` that imports it at its first attribute access."""
    return _LazyModule(name)
