"""The artifact cache ships nothing it did not build: damaged entries and edited sources are rebuilt,
the key follows what the build reads from the descriptor, and an unwritable cache is one line."""
from __future__ import annotations

import json
import warnings

import pytest

import flashgen
from flashgen.cli import main
from flashgen.paths import cache_dir
from flashgen.targets import artifacts

WL = flashgen.workload("rmsnorm", M=8, N=200, dtype="fp16")


def _entry(kernel) -> "artifacts.Path":
    return artifacts.entry(kernel.metadata["cache_key"])


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "delete", "extra", "manifest", "no-manifest",
                                    "info-resigned"])
def test_a_damaged_cache_entry_is_rebuilt_with_one_warning(damage):
    first = flashgen.compile(WL, target="h200", schedule={"block_r": 1, "block_c": 256, "num_warps": 2})
    folder = _entry(first)
    cubin = next(p for p in folder.iterdir() if p.suffix == ".cubin")
    raw = bytearray(cubin.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x40
        cubin.write_bytes(bytes(raw))
    elif damage == "truncate":
        cubin.write_bytes(bytes(raw[:100]))
    elif damage == "empty":
        cubin.write_bytes(b"")
    elif damage == "delete":
        cubin.unlink()
    elif damage == "extra":
        (folder / "evil.so").write_bytes(b"\x7fELF")
    elif damage == "manifest":
        (folder / artifacts.MANIFEST).write_text("{garbage")
    elif damage == "info-resigned":  # garbage flashgen.json with a manifest rewritten to match it
        (folder / "flashgen.json").write_text("[1, 2")
        manifest = json.loads((folder / artifacts.MANIFEST).read_text())
        manifest["flashgen.json"] = artifacts._sha256(b"[1, 2")
        (folder / artifacts.MANIFEST).write_text(json.dumps(manifest))
    else:
        (folder / artifacts.MANIFEST).unlink()
    with pytest.warns(UserWarning, match="building it again"):
        again = flashgen.compile(WL, target="h200", schedule={"block_r": 1, "block_c": 256, "num_warps": 2})
    assert again.binary == first.binary and again.source == first.source
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry is whole
        flashgen.compile(WL, target="h200", schedule={"block_r": 1, "block_c": 256, "num_warps": 2})


def test_an_edited_cached_source_is_not_imported():
    schedule = {"block_r": 2, "block_c": 256, "num_warps": 2}
    k = flashgen.compile(WL, target="h200", schedule=schedule)
    [path] = [p for p in (cache_dir() / "source").glob("fg_rmsnorm_kernel_*.py") if p.read_text() == k.source]
    path.write_text("raise SystemExit('this code must never run')\n")
    again = flashgen.compile(WL, target="h200", schedule=schedule)  # imports the module to load the binary
    assert again.binary == k.binary and path.read_text() == k.source


def test_the_cache_key_follows_the_descriptor_not_its_name(tmp_path, capsys):
    desc = {"key": "cuda:lab", "vendor": "nvidia", "backend": "triton", "arch": "sm_86", "triton_target": ["cuda", 86],
            "warp_size": 32, "dtypes": ["fp32", "fp16", "bf16", "int8", "int32", "int64"], "smem_per_block": 101376,
            "devices": {"l40s": {"sm_count": 142, "mem_bandwidth_gbs": 864, "peak_tflops": {"fp32": 91.6, "bf16": 362, "int8": 724}}}}
    argv = ["compile", "rmsnorm", "--dim", "M=8", "--dim", "N=200", "--dtype", "fp16", "--target", "l40s",
            "--targets-dir", str(tmp_path / "d")]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "l40s.json").write_text(json.dumps(desc))
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    desc.update(arch="sm_89", triton_target=["cuda", 89])  # the same key and name, another build
    (tmp_path / "d" / "l40s.json").write_text(json.dumps(desc))
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert ".target sm_86" in (tmp_path / "a" / "rmsnorm_kernel.ptx").read_text()
    assert ".target sm_89" in (tmp_path / "b" / "rmsnorm_kernel.ptx").read_text()


def test_a_kernel_cached_by_another_triton_is_not_served(monkeypatch):
    """The Triton that built a kernel is in its cache key and its JSON: another Triton builds its own."""
    import triton
    schedule = {"block_r": 2, "block_c": 256, "num_warps": 1}
    first = flashgen.compile(WL, target="h200", schedule=schedule)
    assert first.metadata["tools"]["triton"] == triton.__version__
    monkeypatch.setattr(triton, "__version__", "3.6.0+other")
    second = flashgen.compile(WL, target="h200", schedule=schedule)
    assert second.metadata["cache_key"] != first.metadata["cache_key"]
    assert second.metadata["tools"]["triton"] == "3.6.0+other"
    assert _entry(first).is_dir() and _entry(second).is_dir()


def test_an_unwritable_cache_is_one_line(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHGEN_CACHE_DIR", str(blocker / "under-a-file"))
    code = main(["compile", "rmsnorm", "--dim", "M=8", "--dim", "N=200", "--dtype", "fp16", "--target", "h200",
                 "--out", str(tmp_path / "o")])
    lines = capsys.readouterr().err.strip().splitlines()  # (the build's status line, then the error in one)
    assert code == 2 and len(lines) == 2 and lines[0].startswith("building rmsnorm") and "FLASHGEN_CACHE_DIR" in lines[1]


def test_out_is_whole_or_has_no_metadata_and_leaves_no_staging(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    from flashgen.targets import kernel as kernel_mod

    out = tmp_path / "out"
    a = flashgen.compile(WL, target="h200", schedule={"block_r": 1, "block_c": 256, "num_warps": 2})
    b = flashgen.compile(WL, target="h200", schedule={"block_r": 8, "block_c": 256, "num_warps": 4})
    a.save(out)
    real, calls = os.replace, []

    def dying(src, dst):  # the process dies after moving two of the new files
        calls.append(dst)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(kernel_mod.os, "replace", dying)
    with pytest.raises(KeyboardInterrupt):
        b.save(out)
    monkeypatch.setattr(kernel_mod.os, "replace", real)
    assert not (out / f"{b.name}.json").exists()  # no metadata describing a mixed folder
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / f"{kernel_mod.STAGE_PREFIX}{dead.pid}-x").mkdir()  # a stage of a killed save
    b.save(out)
    meta = json.loads((out / f"{b.name}.json").read_text())
    import hashlib
    for name, digest in meta["sha256"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert not list(out.glob(".flashgen-*"))


def test_a_save_over_another_kernel_leaves_none_of_its_files(tmp_path):
    """Saving a cpu kernel where an h200 kernel of the same name was saved: the files the old JSON listed
    (its runnable .py, .cubin, .ptx) go, so the folder never holds a kernel the new JSON does not
    describe; files flashgen did not list there (a user's notes, a file the old JSON names outside the
    folder) are left alone."""
    out = tmp_path / "out"
    gpu = flashgen.compile(WL, target="h200", schedule={"block_r": 1, "block_c": 256, "num_warps": 2})
    old = {p.name for p in gpu.save(out)}
    (out / "notes.txt").write_text("mine")
    meta = json.loads((out / f"{gpu.name}.json").read_text())
    (tmp_path / "outside.txt").write_text("x")
    meta["files"] += ["../outside.txt", "sub/x", 3]
    (out / f"{gpu.name}.json").write_text(json.dumps(meta))
    cpu = flashgen.compile(flashgen.workload("rmsnorm", M=8, N=200, dtype="fp32"), target="cpu")
    new = {p.name for p in cpu.save(out)}
    assert {f"{gpu.name}.cubin", f"{gpu.name}.py"} <= old - new
    assert {p.name for p in out.iterdir()} == new | {"notes.txt"}
    assert (tmp_path / "outside.txt").exists()
    saved = json.loads((out / f"{cpu.name}.json").read_text())
    assert saved["workload_key"] == cpu.workload.key and saved["workload"] == cpu.workload.to_json()


def test_a_stray_file_where_an_entry_goes_is_replaced():
    """A file (not a folder) at an entry's path was left by rmtree and failed every later store with
    "set FLASHGEN_CACHE_DIR to a writable folder"; it is replaced by the entry."""
    key = artifacts.artifact_key({"probe": "stray"})
    folder = artifacts.entry(key)
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.write_text("junk")
    found = artifacts.store(key, {"a.bin": b"abc"})
    assert folder.is_dir() and found["a.bin"].read_bytes() == b"abc"
