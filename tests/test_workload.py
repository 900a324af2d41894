"""Workloads: validation of dims and attrs, canonical JSON and a key that never drifts."""
from __future__ import annotations

import subprocess
import sys

import pytest

import flashgen
from flashgen.errors import FlashgenError
from flashgen.workload import Workload


def test_key_is_stable_and_canonical():
    a = flashgen.workload("rmsnorm", M=4096, N=8192, dtype="bf16")
    b = flashgen.workload("rmsnorm", dtype="bf16", N=8192, M=4096)
    assert a == b and a.key == b.key
    # Pinned: the database and the runtime find kernels by this key, so it must not change silently.
    assert a.canonical() == '{"attrs":{"dtype":"bf16"},"dims":{"M":4096,"N":8192},"op":"rmsnorm"}'
    assert a.key == "rmsnorm-4d37d8da4894c887"
    out = subprocess.run([sys.executable, "-c", "import flashgen; print(flashgen.workload("
                          "'rmsnorm', M=4096, N=8192, dtype='bf16').key)"], capture_output=True, text=True)
    assert out.stdout.strip() == a.key


def test_defaults_and_round_trip():
    wl = flashgen.workload("dynamic_quant", M=3, N=5)
    assert wl.attr == {"dtype": "bf16", "out_dtype": "int8"}
    assert Workload.from_json(wl.to_json()) == wl
    assert wl.shape("scale") == (3,) and wl.tensor_dtype("scale") == "fp32"
    assert flashgen.workload("silu_mul", M=2, N=7).shape("x") == (2, 14)


@pytest.mark.parametrize("kw, message", [
    (dict(M=4), "missing dim N"),
    (dict(M=4, N=8, K=2), "unknown dim or attribute 'K'"),
    (dict(M=0, N=8), "must be positive"),
    (dict(M=-3, N=8), "must be positive"),
    (dict(M=1 << 30, N=8), "absurd"),
    (dict(M=4, N="x"), "must be an integer"),
    (dict(M=4, N=8, dtype="int8"), "dtype=int8 is not supported"),
    (dict(M=1 << 23, N=1 << 23), "over the limit"),
])
def test_bad_workloads(kw, message):
    with pytest.raises(FlashgenError, match=message):
        flashgen.workload("rmsnorm", **kw)


def test_op_specific_checks():
    with pytest.raises(FlashgenError, match="even head dim"):
        flashgen.workload("rope", M=1, Hq=1, Hkv=1, D=63, L=8)
    with pytest.raises(FlashgenError, match="unknown op 'rmsnrom'.*rmsnorm"):
        flashgen.workload("rmsnrom", M=1, N=1)
