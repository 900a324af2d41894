"""Optional packages: imported where a feature needs them, with a one-line error naming the extra.

Everything a command needs is a core dependency; what stays optional (matplotlib for `--plot`,
transformers for the peer baselines of benchmarks and tests, ray for `tune --ray`) is asked for here, so a plain install
reports the missing extra instead of a ModuleNotFoundError traceback.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from flashgen.errors import FlashgenError

# The extra of pyproject.toml that installs each optional top-level module.
EXTRAS = {"matplotlib": "plot", "transformers": "peers", "ray": "ray"}


def require(module: str, purpose: str) -> ModuleType:
    """The module, or a FlashgenError saying which extra installs it and what needs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = EXTRAS.get(module.split(".")[0])
        how = f"pip install 'flashgen[{extra}]'" if extra else f"pip install {module.split('.')[0]}"
        raise FlashgenError(f"{purpose} needs the {module.split('.')[0]} package: {how}") from None
