"""benchmarks/common.py `variant`: a schedule with one knob changed is timed only where it is a valid
schedule whose kernel computes what the original's does; otherwise one line says why."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

import flashgen
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import variant  # noqa: E402


def test_variant_kept_only_where_valid_and_equal(capsys):
    wl = flashgen.workload("rmsnorm", M=5, N=300, dtype="fp32")
    target = get_target("cpu")
    space = ScheduleSpace(wl, target)
    base = {"block_r": 2, "block_c": 64, "num_warps": 1}
    ins = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(1))
    out = flashgen.compile(wl, target, schedule=base).run(ins)

    found = variant(wl, target, space, base, "block_c", 128, ins, out)
    assert found is not None
    kern, s = found
    assert s == {**base, "block_c": 128} and kern.schedule == s
    assert all(torch.allclose(kern.run(ins)[n], out[n]) for n in out)

    assert variant(wl, target, space, base, "block_c", 64, ins, out) is None  # the knob already holds it
    assert capsys.readouterr().out == ""
    assert variant(wl, target, space, base, "persistent", 1, ins, out) is None
    assert "not a knob of rmsnorm" in capsys.readouterr().out
    assert variant(wl, target, space, base, "block_c", 100, ins, out) is None
    assert "block_c=100 is not one of" in capsys.readouterr().out
    wrong = {n: v * 2 + 1 for n, v in out.items()}
    assert variant(wl, target, space, base, "block_c", 128, ins, wrong) is None
    assert "outputs differ" in capsys.readouterr().out


def test_weight_reads_pass_over_every_weight_byte():
    """gemm.py's `read` passes go over the weight's bytes as int32 words: packed int4 words as they are,
    a 16-bit matrix two elements a word; the maximum is that of every word and the copy holds them all."""
    from gemm import make_workload, weight_reads

    for op, dims in (("gemm_w4a16", (3, 200, 256)), ("gemm", (5, 33, 70))):
        wl = make_workload(op, *dims)
        ins = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(2))
        w = ins.get("w_packed", ins.get("w"))
        words = w.contiguous().reshape(-1).view(torch.int32)
        assert words.numel() * 4 == w.numel() * w.element_size()
        reads = weight_reads(ins)
        assert int(reads["read max"]()) == int(words.max())
        assert torch.equal(reads["read copy"](), words)
