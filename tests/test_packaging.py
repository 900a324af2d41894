"""The package list in pyproject.toml names every package of the tree: a plain (non-editable) install
must carry all of them."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_installed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    for name, folder in cfg["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            package = ".".join([name, *rel.parts])
            assert package in listed, f"{package} ({init.parent}) is not in pyproject's packages"
    data = cfg["package-data"]
    assert "shipped/*.jsonl" in data["flashgen.db"] and "descriptors/*.json" in data["flashgen.targets"]
