"""Environment variables that turn a feature on or off, read one way everywhere."""
from __future__ import annotations

import os

from flashgen.errors import FlashgenError

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def switch(name: str, default: bool = True) -> bool:
    """Whether the variable `name` turns its feature on: the usual words in any letter case (unset or
    empty: `default`). Any other value is refused in one line: a typo such as `flase` must not leave
    the feature in the state the user meant to change."""
    value = os.environ.get(name, "")
    word = value.strip().lower()
    if not word:
        return default
    if word in ON:
        return True
    if word in OFF:
        return False
    raise FlashgenError(f"{name}={value!r} is neither on ({'/'.join(ON)}) nor off ({'/'.join(OFF)})")
