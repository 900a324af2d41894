"""benchmarks/studies/behind_ranks.py: the replay of records timed alone against records timed behind a producer."""
import json
import sys
from pathlib import Path

import pytest

import flashgen
from flashgen.db import Record
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
import behind_ranks  # noqa: E402

H200 = get_target("h200")
WL = flashgen.workload("gemm", M=1, N=512, K=1024, dtype="bf16")
PRODUCER = flashgen.workload("rmsnorm", M=1, N=1024, dtype="bf16")


def _rec(us: float, timing: str = "alone", status: str = "ok", **knobs) -> Record:
    s = {**ScheduleSpace(WL, H200).default(), **knobs}
    extra = {"timing": "behind", "behind": PRODUCER.to_json()} if timing == "behind" else {}
    return Record(workload_key=WL.key, workload=WL.to_json(), target_key=H200.id, schedule=s, status=status,
                  latency_us=us if status == "ok" else None, device="NVIDIA H200", extra=extra)


def test_reversed_order_and_the_alone_rank_of_the_fastest_behind(tmp_path, capsys, monkeypatch):
    """Three schedules timed both ways in opposite orders: correlation -1, the fastest behind is the
    slowest alone; a schedule timed only behind counts in timed_behind, not in timed_both; the older of
    two alone timings of a schedule does not count, nor does a failure."""
    alone = [_rec(10.0, num_stages=2), _rec(11.0, num_stages=3), _rec(12.0, num_stages=4), _rec(15.0, num_stages=4),
             _rec(1.0, status="crash", num_stages=5)]
    behind = [_rec(9.0, "behind", num_stages=2), _rec(8.0, "behind", num_stages=3), _rec(7.0, "behind", num_stages=4),
              _rec(7.5, "behind", num_warps=2)]
    files = []
    for name, recs in (("alone.jsonl", alone), ("behind.jsonl", behind)):
        files.append(tmp_path / name)
        files[-1].write_text("".join(json.dumps(r.to_json()) + "\n" for r in recs))
    monkeypatch.setattr(sys, "argv", ["behind_ranks.py", *map(str, files), "--out-dir", str(tmp_path), "--name", "t"])
    behind_ranks.main()
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert len(rows) == 1
    row = dict(zip(behind_ranks.HEADER, rows[0]))
    assert row["records"] == "behind.jsonl" and row["behind"] == "rmsnorm"
    assert (row["timed_behind"], row["timed_both"], row["alone_schedules"]) == (4, 3, 3)
    assert row["spearman"] == pytest.approx(-1.0)
    assert row["best_behind_us"] == 7.0 and row["its_alone_rank"] == 3
    default_stages = ScheduleSpace(WL, H200).default()["num_stages"]
    assert row["default_behind_rank"] == {2: 4, 3: 3, 4: 1}.get(default_stages)
    assert "spearman" in capsys.readouterr().out
