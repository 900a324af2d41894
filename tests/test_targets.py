"""Target descriptors: built-in ones, names that reach them, and user descriptor folders."""
from __future__ import annotations

import json

import pytest

from flashgen.errors import FlashgenError
from flashgen.targets import get_target, load_targets

NEW_GPU = {
    "key": "cuda:sm_89", "vendor": "nvidia", "backend": "triton", "arch": "sm_89",
    "triton_target": ["cuda", 89], "warp_size": 32, "dtypes": ["fp32", "fp16", "bf16", "int8", "int64"],
    "devices": {"l40s": {"sm_count": 142, "mem_bandwidth_gbs": 864, "peak_tflops": {"bf16": 362}}},
}


def test_builtin_targets_and_names():
    ids = set(load_targets())
    assert {"cuda:sm_80/a100", "cuda:sm_90/h100", "cuda:sm_90/h200", "rocm:gfx90a/mi250",
            "rocm:gfx942/mi300x", "cpu/host"} <= ids
    assert get_target("h200").id == "cuda:sm_90/h200"
    assert get_target("H100").id == "cuda:sm_90/h100"
    assert get_target("cuda:sm_90").device == "h100"
    assert get_target("gfx942").device == "mi300x"
    assert get_target("rocm:gfx90a").warp_size == 64
    assert get_target("cpu").backend == "tvm"
    assert get_target("h200").copy_gbs < get_target("h200").mem_bandwidth_gbs


def test_unknown_target_lists_choices():
    with pytest.raises(FlashgenError, match="unknown target 'h900'.*h200"):
        get_target("h900")


def test_user_folder_adds_a_target(tmp_path, monkeypatch):
    (tmp_path / "l40s.json").write_text(json.dumps(NEW_GPU))
    monkeypatch.setenv("FLASHGEN_TARGETS_PATH", str(tmp_path))
    t = get_target("l40s")
    assert (t.id, t.arch, t.sm_count) == ("cuda:sm_89/l40s", "sm_89", 142)
    import flashgen
    k = flashgen.compile(flashgen.workload("rmsnorm", M=8, N=1024, dtype="bf16"), "l40s")
    assert ".target sm_89" in k.asm["ptx"] and k.binary[:4] == b"\x7fELF"


def test_folder_argument_adds_a_target(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps(NEW_GPU))
    assert get_target("l40s", [tmp_path]).key == "cuda:sm_89"


@pytest.mark.parametrize("broken, message", [
    ("{not json", "unreadable"),
    (json.dumps({"key": "x"}), "lacks vendor"),
    (json.dumps({**NEW_GPU, "backend": "opencl"}), "backend must be one of"),
    (json.dumps({**NEW_GPU, "devices": {"z": {"sm_count": 1}}}), "device z lacks"),
])
def test_bad_descriptor_is_a_clear_error(tmp_path, broken, message):
    (tmp_path / "bad.json").write_text(broken)
    with pytest.raises(FlashgenError, match=message):
        load_targets([tmp_path])
