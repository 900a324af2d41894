"""Ahead-of-time builds for NVIDIA and AMD targets on a machine with no GPU."""
from __future__ import annotations

import pytest

import flashgen
from flashgen.oplib import OPS
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target

TARGETS = ("sm_80", "sm_90", "gfx90a", "gfx942")


def _workload(op: str):
    if op == "rope":
        return flashgen.workload("rope", M=7, Hq=8, Hkv=2, D=128, L=512, dtype="bf16")
    if op == "rope_cache":
        return flashgen.workload("rope_cache", M=7, Hq=8, Hkv=2, D=128, L=512, NS=4096, dtype="bf16")
    if op.startswith("rope") and op.endswith("partial"):  # Phi-2's head: 32 of 80 elements rotate
        return flashgen.workload(op, M=7, Hq=32, Hkv=32, D=80, R=32, L=2048, dtype="bf16",
                                 **({"NS": 4096} if "cache" in op else {}))
    if op.startswith("dequant_"):  # a weight's rows and columns
        return flashgen.workload(op, N=4096, K=1024, dtype="bf16", **({"G": 128} if "G" in OPS[op].dims else {}))
    if op == "moe_route":  # Qwen3-MoE's router: 128 experts, 8 a token
        return flashgen.workload(op, M=33, E=128, topk="8", dtype="bf16")
    return flashgen.workload(op, M=33, N=4096, dtype="bf16")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("op", sorted(n for n, o in OPS.items() if o.kclass in ("rowwise", "pointwise")))
def test_aot_compile(op, target):
    k = flashgen.compile(_workload(op), target)
    assert k.binary[:4] == b"\x7fELF", "binary is not an ELF object"
    assert k.metadata["binary_symbol"].encode() in k.binary
    text = k.asm["ptx"] if target.startswith("sm_") else k.asm["amdgcn"]
    assert k.metadata["binary_symbol"] in text
    if target.startswith("sm_"):
        assert f".target {target}" in text and k.binary_kind == "cubin"
    else:
        assert f"amdgcn-amd-amdhsa--{target}" in text and k.binary_kind == "hsaco"
    assert k.metadata["schedule_source"] == "analytic default"


def test_fp8_output_on_sm90():
    wl = flashgen.workload("dynamic_quant", M=4, N=4096, dtype="bf16", out_dtype="fp8e4m3")
    k = flashgen.compile(wl, "sm_90")
    assert "cvt.rn.satfinite.e4m3x2.f32" in k.asm["ptx"]


def test_fp8_refused_where_target_lacks_it():
    wl = flashgen.workload("dynamic_quant", M=4, N=4096, dtype="bf16", out_dtype="fp8e4m3")
    with pytest.raises(flashgen.FlashgenError, match="does not support fp8e4m3"):
        flashgen.compile(wl, "sm_80")


def test_wide_loads_in_rmsnorm_ptx():
    """A whole bf16 row per program with 16-byte-aligned pointers: loads are 128-bit vectors."""
    k = flashgen.compile(flashgen.workload("rmsnorm", M=4096, N=8192, dtype="bf16"), "sm_90")
    assert "ld.global.v4.b32" in k.asm["ptx"] or "ld.global.v4.u32" in k.asm["ptx"]


@pytest.mark.parametrize("op, dims", [("rmsnorm", dict(M=3, N=4096)), ("gemm", dict(M=1, N=512, K=1024)),
                                      ("paged_decode_attention", dict(B=2, Hq=8, Hkv=2, D=64, BS=16, NB=64, MAXB=8,
                                                                      L=128))])
def test_programmatic_dependent_launch_on_sm90_only(op, dims, monkeypatch):
    """sm_90 binaries wait for the previous kernel before their first memory access and are launched with
    programmatic stream serialization; sm_80 and AMD binaries, and FLASHGEN_PDL=0 builds, have neither.
    (The GEMV's default loads its first weights early, before the wait: here it is built without.)"""
    wl = flashgen.workload(op, dtype="bf16", **dims)
    for target in ("sm_90", "sm_80", "gfx942"):
        space = ScheduleSpace(wl, get_target(target))
        early = space.has_variants and space.flat(space.default())["early_load"]
        k = flashgen.compile(wl, target, schedule=space.with_knob(space.default(), "early_load", 0) if early else None)
        text = k.asm["ptx"] if target.startswith("sm_") else k.asm["amdgcn"]
        on = target == "sm_90"
        assert (text.count("griddepcontrol.wait") == 1) == on and k.metadata["constexprs"]["PDL"] == int(on)
        if target.startswith("sm_"):
            assert k.launcher.compiled.metadata.launch_pdl == on
        if on:  # the wait comes before every global load
            first_load = min(i for i, line in enumerate(text.splitlines()) if "ld.global" in line or "cp.async" in line)
            assert text.splitlines().index(next(x for x in text.splitlines() if "griddepcontrol.wait" in x)) < first_load
    monkeypatch.setenv("FLASHGEN_PDL", "0")
    k = flashgen.compile(wl, "sm_90")
    assert "griddepcontrol" not in k.asm["ptx"] and not k.launcher.compiled.metadata.launch_pdl
