"""The environment switches (FLASHGEN_SHIPPED, FLASHGEN_PDL, FLASHGEN_NATIVE_LAUNCH) read the usual words
for on and off, and refuse any other value in one line: `FLASHGEN_PDL=false` built with PDL."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import flashgen
from flashgen.errors import FlashgenError
from flashgen.targets import get_target
from flashgen.targets.triton.build import compile_options, for_target
from flashgen.targets.triton.codegen import generate
from flashgen.targets.triton.native_launch import native_launch

OFF = ["0", "false", "False", "NO", "off", " off "]
ON = ["1", "true", "TRUE", "yes", "On", ""]
OTHER = ["flase", "2", "disable"]


def _pdl_kernel():
    wl = flashgen.workload("rmsnorm", M=4, N=64, dtype="fp32")
    return generate(wl, {"block_r": 1, "block_c": 64, "num_warps": 1})


@pytest.mark.parametrize("value, on", [(v, False) for v in OFF] + [(v, True) for v in ON])
def test_pdl_switch_reads_the_usual_words(monkeypatch, value, on):
    monkeypatch.setenv("FLASHGEN_PDL", value)
    options = compile_options(for_target(_pdl_kernel(), get_target("h200")), {"num_warps": 1})
    assert options.get("launch_pdl", False) == on


def _compiled() -> SimpleNamespace:
    md = {"backend_name": "cuda", "global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1,
          "launch_cooperative_grid": False, "num_warps": 4, "shared": 1024, "launch_pdl": True}
    return SimpleNamespace(metadata=SimpleNamespace(**md), function=1234, _init_handles=lambda: None)


@pytest.mark.parametrize("value, on", [(v, False) for v in OFF] + [(v, True) for v in ON])
def test_native_launch_switch_reads_the_usual_words(monkeypatch, value, on):
    monkeypatch.setenv("FLASHGEN_NATIVE_LAUNCH", value)
    assert (native_launch(_compiled(), "ppif", 0) is not None) == on


@pytest.mark.parametrize("value", OTHER)
def test_other_values_are_refused_in_one_line(monkeypatch, value):
    for name, read in (("FLASHGEN_PDL", lambda: for_target(_pdl_kernel(), get_target("h200"))),
                       ("FLASHGEN_NATIVE_LAUNCH", lambda: native_launch(_compiled(), "ppif", 0))):
        monkeypatch.setenv(name, value)
        with pytest.raises(FlashgenError) as e:
            read()
        assert str(e.value) == f"{name}={value!r} is neither on (1/true/yes/on) nor off (0/false/no/off)"
        monkeypatch.delenv(name)
