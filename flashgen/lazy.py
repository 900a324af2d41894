"""Modules imported on first use: the commands that compute nothing (`--help`, `ops`, `targets`, `db`)
start without loading torch, which alone takes longer than they should."""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable


class _LazyModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attr)


def lazy(name: str) -> Any:
    """A stand-in for module `name` that imports it at its first attribute access."""
    return _LazyModule(name)


def exports(package: str, table: dict[str, str]) -> Callable[[str], Any]:
    """A package's module `__getattr__` that imports each name of `table` (name -> the module defining
    it) at its first use and keeps it: importing one module of the package loads none of the others."""
    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(table[name]), name)
        setattr(sys.modules[package], name, value)
        return value
    return __getattr__
