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


def _bad(**change):
    return json.dumps({**NEW_GPU, **change})


def _bad_device(**change):
    return json.dumps({**NEW_GPU, "devices": {"l40s": {**NEW_GPU["devices"]["l40s"], **change}}})


@pytest.mark.parametrize("broken, message", [
    (_bad(warp_size=0), "warp_size of a nvidia target must be 32"),
    (_bad(warp_size="32"), "warp_size"),
    (_bad(vendor="intel"), "vendor must be one of"),
    (_bad(backend="tvm"), "backend of a nvidia target must be triton"),
    (_bad(dtypes="fp16"), "dtypes must be a list"),
    (_bad(dtypes=["fp16", "fp4"]), "unknown dtypes fp4"),
    (_bad(arch="89"), "arch of an nvidia target must read sm_NN"),
    (_bad(triton_target=["cuda", "89"]), "triton_target must be"),
    (_bad(triton_target=["hip", 89]), "triton_target must be"),
    (_bad(smem_per_block=-5), "smem_per_block must be a whole number"),
    (_bad(key=""), "key must be a non-empty name"),
    (_bad_device(sm_count=0), "devices.l40s.sm_count must be a whole number >= 1"),
    (_bad_device(sm_count=1.5), "devices.l40s.sm_count"),
    (_bad_device(mem_bandwidth_gbs=0), "devices.l40s.mem_bandwidth_gbs must be a positive number"),
    (_bad_device(mem_bandwidth_gbs=float("nan")), "mem_bandwidth_gbs"),
    (_bad_device(peak_tflops={"bf16": -1}), "peak_tflops.bf16 must be a positive number"),
    (_bad_device(peak_tflops={"bogus": 1}), "unknown dtype 'bogus'"),
    (_bad_device(device_names="NVIDIA L40S"), "device_names must be a list"),
])
def test_descriptor_fields_are_checked_with_file_and_field_named(tmp_path, broken, message):
    (tmp_path / "bad.json").write_text(broken)
    with pytest.raises(FlashgenError, match=message) as e:
        load_targets([tmp_path])
    assert "bad.json" in str(e.value) and "\n" not in str(e.value)


def test_a_builtin_key_is_refused_unless_extended(tmp_path):
    h20 = {"sm_count": 78, "mem_bandwidth_gbs": 4000, "peak_tflops": {"bf16": 148}}
    (tmp_path / "mine.json").write_text(json.dumps({**json.loads(_bad()), "key": "cuda:sm_90", "arch": "sm_90",
                                                    "triton_target": ["cuda", 90], "devices": {"h20": h20}}))
    with pytest.raises(FlashgenError, match="defines 'cuda:sm_90', which .*cuda-sm_90.json defines already"):
        load_targets([tmp_path])
    (tmp_path / "mine.json").write_text(json.dumps({"key": "cuda:sm_90", "extends": True, "devices": {"h20": h20}}))
    targets = load_targets([tmp_path])
    assert {"cuda:sm_90/h100", "cuda:sm_90/h200", "cuda:sm_90/h20"} <= set(targets)
    assert targets["cuda:sm_90/h20"].sm_count == 78 and targets["cuda:sm_90/h200"].sm_count == 132
    (tmp_path / "mine.json").write_text(json.dumps({"key": "cuda:sm_77", "extends": True, "devices": {"x": h20}}))
    with pytest.raises(FlashgenError, match="no earlier file defines"):
        load_targets([tmp_path])


def test_the_minimal_descriptor_builds_every_kernel_class(tmp_path):
    import flashgen

    minimal = {"key": "cuda:sm_89", "vendor": "nvidia", "backend": "triton", "arch": "sm_89",
               "triton_target": ["cuda", 89], "warp_size": 32, "dtypes": ["fp32", "fp16", "bf16", "int8", "int64"],
               "devices": {"l40s": {"sm_count": 142, "mem_bandwidth_gbs": 864, "peak_tflops": {"bf16": 362}}}}
    (tmp_path / "l40s.json").write_text(json.dumps(minimal))
    t = get_target("l40s", [tmp_path])
    assert t.get("smem_per_block") == 101376 and "int32" in t.dtypes
    for wl in (flashgen.workload("rmsnorm", M=8, N=1024, dtype="bf16"),
               flashgen.workload("silu_mul", M=8, N=1024, dtype="bf16"),
               flashgen.workload("gemm", M=16, N=256, K=512, dtype="bf16"),
               flashgen.workload("gemm_w4a16", M=1, N=256, K=512, G=128, dtype="fp16"),
               flashgen.workload("paged_decode_attention", B=2, Hq=8, Hkv=2, D=128, BS=16, NB=64, MAXB=8, L=128,
                                 dtype="fp16")):
        k = flashgen.compile(wl, t)
        assert k.binary[:4] == b"\x7fELF" and ".target sm_89" in k.asm["ptx"]
