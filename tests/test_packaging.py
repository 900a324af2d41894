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


def test_the_wheel_carries_its_data_and_runs_command_1_outside_the_checkout(tmp_path):
    """The wheel a plain build makes holds every descriptor and shipped record (package data a wheel
    leaves out without its package-data lines), and installed alone, away from the checkout, runs
    README command 1 on the shipped H200 record. (Built from a copy of the tree: the build writes
    build/ beside its sources.)"""
    import os
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"
    for name in ("flashgen", "schedules", "targets", "runtime"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", src)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src), "-w", str(tmp_path)],
                   check=True, capture_output=True)
    wheel, = tmp_path.glob("flashgen-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {f"flashgen/targets/descriptors/{p.name}" for p in (ROOT / "targets" / "descriptors").glob("*.json")} | \
        {f"flashgen/db/shipped/{p.name}" for p in (ROOT / "flashgen" / "db" / "shipped").iterdir()
         if p.suffix == ".jsonl" or p.name == "MANIFEST.json"}
    assert "flashgen/db/shipped/MANIFEST.json" in data and len(data) > 3 and data <= names, sorted(data - names)

    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True,
                   capture_output=True)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "FLASHGEN_DB": str(cwd / "none.db"),
           "FLASHGEN_CACHE_DIR": str(cwd / "cache")}
    env.pop("FLASHGEN_SHIPPED", None)
    where = subprocess.run([sys.executable, "-c", "import flashgen.cli; print(flashgen.cli.__file__)"], cwd=cwd,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where == str(site / "flashgen" / "cli.py")  # the installed copy, not the checkout's
    done = subprocess.run([sys.executable, "-m", "flashgen.cli", "compile", "rmsnorm", "--dim", "M=4096", "--dim",
                           "N=8192", "--dtype", "bf16", "--target", "h200", "--out", "out/rmsnorm"], cwd=cwd, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-1500:]
    assert "shipped records)]" in done.stdout, done.stdout  # the record that ships, checked against MANIFEST.json
    assert {p.name for p in (cwd / "out" / "rmsnorm").iterdir()} >= {"rmsnorm_kernel.py", "rmsnorm_kernel.cubin",
                                                                    "rmsnorm_kernel.json"}
