"""What a plain install gets: every package of the tree (a non-editable install must carry all of
them), and requirements that resolve together from the public index."""
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


def test_the_set_up_leaves_torch_to_the_resolver():
    """On the public index each torch CUDA wheel requires one Triton release, so a pinned torch and the
    Triton pin can exclude each other (torch 2.13.0 needs triton 3.7.1): neither the requirements nor
    the README's set-up commands name a torch release, and Triton stays pinned."""
    import re
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    torch = [r for r in requirements if re.match(r"torch\b", r)]
    assert torch and all(not re.search(r"==|<", r) for r in torch), torch
    assert "triton==3.6.0" in project["dependencies"]
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv")]
    assert len(commands) == 2 and not any("torch==" in line for line in commands), commands
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
