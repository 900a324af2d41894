"""Target descriptors: built-in ones, names that reach them, and user descriptor folders."""
from __future__ import annotations

import json
import re

import pytest

from flashgen.errors import FlashgenError
from flashgen.targets import descriptor_check, get_target, load_targets

NEW_GPU = {
    "key": "cuda:sm_89", "vendor": "nvidia", "backend": "triton", "arch": "sm_89",
    "triton_target": ["cuda", 89], "warp_size": 32, "dtypes": ["fp32", "fp16", "bf16", "int8", "int64"],
    "devices": {"l40s": {"sm_count": 142, "mem_bandwidth_gbs": 864, "peak_tflops": {"fp32": 91.6, "bf16": 362, "int8": 724}}},
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
    (_bad(warp_size=0), "warp_size of sm_89 must be 32"),
    (_bad(warp_size="32"), "warp_size"),
    (_bad(vendor="intel"), "vendor must be one of"),
    (_bad(backend="tvm"), "backend of nvidia targets must be one of triton,"),
    (_bad(dtypes="fp16"), "dtypes must be a list"),
    (_bad(dtypes=["fp16", "fp4"]), "unknown dtypes fp4"),
    (_bad(arch="89"), "arch of nvidia targets must be one of sm_80, "),
    (_bad(triton_target=["cuda", "89"]), "triton_target must be"),
    (_bad(triton_target=["hip", 89]), "triton_target must be"),
    (_bad(smem_per_block=-5), "smem_per_block must be a whole number"),
    (_bad(key=""), "key must be a name such as"),
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


H20 = {"sm_count": 78, "mem_bandwidth_gbs": 4000, "peak_tflops": {"fp32": 44, "bf16": 148, "int8": 296, "fp8e4m3": 296}}


def _extends(**change):
    return json.dumps({"key": "cuda:sm_90", "extends": True, "devices": {"h20": H20}, **change})


def _amd(**change):
    return _bad(**{"vendor": "amd", "arch": "gfx942", "warp_size": 64, "triton_target": ["hip", "gfx942"], **change})


@pytest.mark.parametrize("broken, field, message", [
    # 1: an extending file may not change what a binary of its key is built from, nor a device its arch's
    pytest.param(_extends(arch="sm_80"), "arch", "may not change in a file that extends cuda:sm_90",
                 id="1-extends-arch"),
    pytest.param(_extends(vendor="amd"), "vendor", "may not change", id="1-extends-vendor"),
    pytest.param(_extends(triton_target=["cuda", 80]), "triton_target", "may not change", id="1-extends-triton_target"),
    pytest.param(_bad_device(arch="sm_90"), "devices.l40s.arch", "belongs to the architecture", id="1-device-arch"),
    pytest.param(_bad_device(key="cuda:sm_90"), "devices.l40s.key", "belongs to the architecture", id="1-device-key"),
    # 2: triton_target is what the arch implies
    pytest.param(_bad(triton_target=["cuda", 80]), "triton_target", r"must be \['cuda', 89\] for arch sm_89",
                 id="2-sm_89-built-as-sm_80"),
    pytest.param(_bad(triton_target=["hip", "gfx942"]), "triton_target", "must be", id="2-sm_89-built-as-gfx942"),
    pytest.param(_amd(triton_target=["hip", "gfx90a"]), "triton_target", "for arch gfx942", id="2-gfx942-as-gfx90a"),
    # 3: only archs the pinned Triton builds, with the warp size Triton gives them
    pytest.param(_bad(arch="sm_10", triton_target=["cuda", 10]), "arch", "must be one of sm_80, .*got 'sm_10'",
                 id="3-sm_10"),
    pytest.param(_bad(arch="sm_90a", triton_target=["cuda", 90]), "arch", "must be one of", id="3-sm_90a"),
    pytest.param(_amd(arch="gfx000", triton_target=["hip", "gfx000"]), "arch", "must be one of gfx908", id="3-gfx000"),
    pytest.param(_amd(warp_size=32), "warp_size", "of gfx942 must be 64", id="3-gfx942-wave32"),
    # 4: names become target ids and file names
    pytest.param(_bad(devices={"a/b": NEW_GPU["devices"]["l40s"]}), "device name 'a/b'", "must be letters",
                 id="4-device-slash"),
    pytest.param(_bad(devices={"": NEW_GPU["devices"]["l40s"]}), "device name ''", "must be letters",
                 id="4-device-empty"),
    pytest.param(_bad(devices={"..": NEW_GPU["devices"]["l40s"]}), "device name '..'", "must be letters",
                 id="4-device-dotdot"),
    pytest.param(_extends(devices={"x/y": H20}), "device name 'x/y'", "must be letters", id="4-extends-device-slash"),
    pytest.param(_bad(key="cuda/sm_89"), "key", "must be a name", id="4-key-slash"),
    # 8: a key that names an arch names the file's: records and kernels are filed under it
    pytest.param(_bad(key="cuda:sm_90"), "key", "'cuda:sm_90' names arch sm_90, but the file's arch is sm_89",
                 id="8-key-sm_90-over-sm_89"),
    pytest.param(_bad(key="sm_86"), "key", "names arch sm_86, but the file's arch is sm_89", id="8-bare-key"),
    pytest.param(_amd(key="rocm:gfx90a"), "key", "names arch gfx90a, but the file's arch is gfx942",
                 id="8-key-gfx90a-over-gfx942"),
    # 5: limits are positive numbers on a GPU; bool is no number
    pytest.param(_bad(smem_per_block=0), "smem_per_block", ">= 1, got 0", id="5-smem-zero"),
    pytest.param(_bad(regs_per_sm=-1), "regs_per_sm", ">= 1", id="5-regs-negative"),
    pytest.param(_bad_device(max_threads_per_block=0), "devices.l40s.max_threads_per_block", ">= 1",
                 id="5-device-threads-zero"),
    pytest.param(_bad_device(l2_bytes=True), "devices.l40s.l2_bytes", "got True", id="5-device-l2-bool"),
    pytest.param(_bad(measured_copy_gbs=0), "measured_copy_gbs", "must be a positive number", id="5-top-copy-zero"),
    pytest.param(_bad_device(sm_count="132"), "devices.l40s.sm_count", "whole number", id="5-sm_count-string"),
    pytest.param(_extends(smem_per_block=0), "smem_per_block", ">= 1", id="5-extends-smem-zero"),
    # 7: a misspelt field would leave a default in force
    pytest.param(_bad(smem_per_blok=1024), "smem_per_blok", "is not a descriptor field; did you mean 'smem_per_block'",
                 id="7-top-typo"),
    pytest.param(_bad_device(l2_byte=1 << 20), "devices.l40s.l2_byte", "did you mean 'l2_bytes'", id="7-device-typo"),
    pytest.param(_extends(mem_bandwith_gbs=900), "mem_bandwith_gbs", "is not a descriptor field", id="7-extends-typo"),
    # 6: JSON of the wrong shape and bytes that are not text
    pytest.param(_bad(vendor=["nvidia"]), "vendor", "must be one of nvidia, amd, cpu", id="6-vendor-list"),
    pytest.param(_bad(key=["cuda:sm_89"]), "key", "must be a name", id="6-key-list"),
    pytest.param(_extends(key=["cuda:sm_90"]), "key", "must be a name", id="6-extends-key-list"),
    pytest.param(_extends(extends=["cuda:sm_90"]), "extends", "must be true or false", id="6-extends-list"),
    pytest.param(_extends(key="cuda:sm_77"), "'cuda:sm_77'", "no earlier file defines", id="6-extends-unknown"),
    pytest.param(_extends(devices=[H20]), "devices", "must be a JSON object", id="6-extends-devices-list"),
    pytest.param(b'{"key": "cuda:sm_89", "vendor": "nvid\xff"}', "is unreadable", "'utf-8' codec", id="6-not-utf8"),
])
def test_descriptor_faults_are_one_line_naming_file_and_field(tmp_path, broken, field, message):
    """What a fault probe found: each was a traceback, an LLVM abort later, or a silently wrong target."""
    (tmp_path / "bad.json").write_bytes(broken if isinstance(broken, bytes) else broken.encode())
    with pytest.raises(FlashgenError) as e:
        load_targets([tmp_path])
    text = str(e.value)
    assert text.startswith(f"target descriptor {tmp_path / 'bad.json'}") and "\n" not in text
    assert field in text and re.search(message, text), text


def test_a_key_that_names_no_arch_is_free(tmp_path):
    """A different build of an arch needs its own key; one naming no arch may say anything."""
    for key in ("cuda:sm_89-lab", "lab", "cuda:l40s"):
        (tmp_path / "l40s.json").write_text(_bad(key=key))
        assert load_targets([tmp_path])[f"{key}/l40s"].arch == "sm_89"


def test_a_file_given_for_a_target_folder_is_named_a_file(tmp_path, monkeypatch):
    (tmp_path / "l40s.json").write_text(json.dumps(NEW_GPU))
    with pytest.raises(FlashgenError, match=r"target folder .*l40s\.json is a file, not a folder"):
        load_targets([tmp_path / "l40s.json"])
    with pytest.raises(FlashgenError, match=r"target folder .*missing does not exist"):
        load_targets([tmp_path / "missing"])
    monkeypatch.setenv("FLASHGEN_TARGETS_PATH", str(tmp_path / "l40s.json"))
    with pytest.raises(FlashgenError, match="is a file, not a folder"):
        get_target("l40s")


def test_every_accepted_arch_loads_with_what_it_implies(tmp_path):
    """Each arch in the accepted set loads from a minimal file whose triton_target and warp size are
    the arch's, and gets its limits filled in; an extending file may restate identity fields unchanged."""
    for vendor, archs in descriptor_check.ARCHS.items():
        for arch, warp in archs.items():
            desc = {**NEW_GPU, "key": f"x:{arch}", "vendor": vendor, "arch": arch, "warp_size": warp,
                    "devices": {f"d-{arch}": NEW_GPU["devices"]["l40s"]}}
            if vendor == "cpu":
                desc["backend"] = "tvm"
                del desc["triton_target"]
            else:
                desc["triton_target"] = ["cuda", int(arch[3:])] if vendor == "nvidia" else ["hip", arch]
            (tmp_path / f"{arch}.json").write_text(json.dumps(desc))
    (tmp_path / "z.json").write_text(_extends(vendor="nvidia", arch="sm_90", smem_per_block=200000))
    targets = load_targets([tmp_path])
    assert all(targets[f"x:{a}/d-{a}"].get("smem_per_block") for vendor, archs in descriptor_check.ARCHS.items()
               if vendor != "cpu" for a in archs)
    assert targets["cuda:sm_90/h20"].get("smem_per_block") == 200000


def test_a_builtin_key_is_refused_unless_extended(tmp_path):
    h20 = {"sm_count": 78, "mem_bandwidth_gbs": 4000, "peak_tflops": {"fp32": 44, "bf16": 148, "int8": 296, "fp8e4m3": 296}}
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
               "devices": {"l40s": {"sm_count": 142, "mem_bandwidth_gbs": 864, "peak_tflops": {"fp32": 91.6, "bf16": 362, "int8": 724}}}}
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


def test_the_peak_rates_the_cost_model_reads_are_required_or_derived(tmp_path, capsys):
    """fp32's rate and that of each listed float dtype and int8 are what the cost model reads: a file with
    a bf16 peak alone is refused naming what it lacks (the model assumed 1 TFLOP/s for the others); a
    missing 16-bit float rate is its twin's, and `flashgen targets` says it was derived."""
    from flashgen.cli import main

    def device(**peaks):
        return {**NEW_GPU, "devices": {"l40s": {"sm_count": 142, "mem_bandwidth_gbs": 864, "peak_tflops": peaks}}}

    for peaks, lacks in (({"bf16": 362}, "fp32"), ({"fp32": 91.6, "bf16": 362}, "int8")):
        (tmp_path / "l40s.json").write_text(json.dumps(device(**peaks)))
        with pytest.raises(FlashgenError, match=rf"l40s.json: devices.l40s.peak_tflops lacks {lacks}: the cost model"):
            load_targets([tmp_path])
    (tmp_path / "l40s.json").write_text(json.dumps(device(fp32=91.6, bf16=362, int8=724)))
    t = get_target("l40s", [tmp_path])
    assert t.peak_tflops == {"fp32": 91.6, "bf16": 362, "int8": 724, "fp16": 362} and t.derived == ("fp16 = bf16's",)
    assert main(["targets", "--targets-dir", str(tmp_path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("cuda:sm_89/l40s"))
    assert line.rstrip().endswith("fp16 = bf16's")
    assert all(not t.derived for t in load_targets().values() if t.vendor != "cpu")  # the shipped GPUs state theirs
