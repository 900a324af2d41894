"""benchmarks/goals.py: the goal each GEMM row is held to, its check, and the per-goal summary."""
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from goals import check, goal_for, read_rows, summary  # noqa: E402

COLUMNS = ["op", "shape", "M", "N", "K", "flashgen_us", "peer", "peer_us", "vs_peer", "roofline_us", "of_roofline",
           "TFLOP/s", "schedule"]


def _row(op, shape, m, us, peer_us, roof_us):
    return [op, shape, m, 4096, 4096, us, "peer", peer_us, peer_us / us, roof_us, roof_us / us, 1.0, "{}"]


def _write(path: Path, rows) -> Path:
    path.write_text(json.dumps({"meta": {"device": "NVIDIA H200"}, "columns": COLUMNS, "rows": rows}))
    return path


def test_goal_by_op_and_m():
    assert goal_for("gemm", 64) == 0.9 and goal_for("gemm", 256) == 0.95 and goal_for("gemm", 8192) == 0.95
    assert goal_for("gemm", 128) is None  # the issue names M <= 64 and M >= 256 only
    assert [goal_for("gemm_w4a16", m) for m in (1, 16, 64, 256, 4096)] == [3.2, 3.2, 2.5, 1.3, 0.9]
    assert goal_for("gemm_w4a16", 32) is None and goal_for("rmsnorm", 1) is None
    assert goal_for("gemm_w8a8", 1) == goal_for("gemm_fp8", 4096) == 0.95


def test_check_met_and_needed_fraction_of_roofline():
    row = dict(zip(COLUMNS, _row("gemm_w4a16", "o", 16, us=5.0, peer_us=12.8, roof_us=2.0)))
    c = check(row)
    assert c[6] == pytest.approx(2.56) and c[7] == 3.2 and c[8] == "no"
    assert c[9] == pytest.approx(4.0)  # goal time: 12.8 / 3.2
    assert c[10] == pytest.approx(0.5) and c[11] == pytest.approx(2.0 / 12.8) and c[12] == pytest.approx(0.4)
    met = check(dict(zip(COLUMNS, _row("gemm", "o", 4096, us=100.0, peer_us=96.0, roof_us=60.0))))
    assert met[8] == "yes" and met[10] == pytest.approx(60.0 / (96.0 / 0.95))
    assert check(dict(zip(COLUMNS, _row("gemm", "o", 128, 1.0, 1.0, 1.0)))) is None


def test_refused_peer_is_no_peer_not_a_miss():
    c = check(dict(zip(COLUMNS, _row("gemm_w8a8", "o", 1, us=4.0, peer_us=math.nan, roof_us=3.0))))
    assert c[8] == "no peer" and math.isnan(c[6]) and c[12] == pytest.approx(0.75)
    assert summary([c]) == []  # a goal with no comparable row has no summary row


def test_later_files_win_and_variants_are_dropped(tmp_path):
    a = _write(tmp_path / "a.json", [_row("gemm", "o", 64, 10.0, 9.0, 5.0), _row("gemm", "qkv", 64, 8.0, 9.0, 5.0),
                                     _row("gemm [tma=1]", "o", 64, 9.0, 9.0, 5.0)])
    b = _write(tmp_path / "b.json", [_row("gemm", "o", 64, 9.5, 9.0, 5.0)])
    rows = {(r["op"], r["shape"]): r for r in read_rows([a, b])}
    assert set(rows) == {("gemm", "o"), ("gemm", "qkv")} and rows[("gemm", "o")]["flashgen_us"] == 9.5
    checked = [check(r) for r in rows.values()]
    (s,) = summary(checked)
    assert s[:5] == ["gemm", "1-64", 0.9, 2, 2] and s[5] == pytest.approx(9.0 / 9.5)
    assert s[6] == pytest.approx(5.0 / 10.0) and s[7] == pytest.approx(5.0 / 10.0)
