"""The tuned records that ship with flashgen: verified before use, valid in today's spaces, overridden
by the user's database, served by compile and listed by `flashgen db --shipped`."""
from __future__ import annotations

import json
import shutil

import pytest

from flashgen.cli import main
from flashgen.db import Database, Record
from flashgen.db import shipped as shipped_mod
from flashgen.db.shipped import ORIGIN, SHIPPED_DIR, TunedRecords, select, shipped_database
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets.descriptor import get_target
from flashgen.workload import recorded_workload, workload


@pytest.fixture(autouse=True)
def _shipped_on(monkeypatch):
    """conftest turns the shipped records off for every other test."""
    monkeypatch.setenv("FLASHGEN_SHIPPED", "1")


def test_every_shipped_record_is_verified_and_valid_in_its_space():
    db = shipped_database()
    assert db is not None
    manifest = json.loads((SHIPPED_DIR / "MANIFEST.json").read_text())
    assert db.count() == sum(e["records"] for e in manifest["files"].values()) > 0
    for rec in db.records():
        wl = recorded_workload(rec.workload, rec.workload_key)
        assert wl is not None, rec.workload
        space = ScheduleSpace(wl, get_target(rec.target_key))
        assert space.is_valid(rec.schedule), (wl, rec.schedule, space.why_invalid(rec.schedule))
        assert rec.status == "ok" and rec.latency_us > 0


def _copy(tmp_path):
    folder = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR, folder)
    return folder


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "manifest"])
def test_a_damaged_shipped_file_is_not_served(tmp_path, damage):
    folder = _copy(tmp_path)
    data = folder / "h200.jsonl"
    raw = bytearray(data.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(bytes(raw[: len(raw) // 3]))
    elif damage == "empty":
        data.write_bytes(b"")
    else:
        (folder / "MANIFEST.json").write_text("{not json")
    with pytest.warns(UserWarning, match="not served|unreadable"):
        assert shipped_mod._read_verified(folder) == []


def test_user_records_override_shipped_ones(tmp_path):
    shipped = shipped_database()
    rec = shipped.best_all("cuda:sm_90/h200")[0]
    other = next(r for r in shipped.best_all("cuda:sm_90/h200") if r.workload_key != rec.workload_key)
    with Database(tmp_path / "u.db") as user:
        mine = Record(workload_key=rec.workload_key, workload=rec.workload, target_key=rec.target_key,
                      schedule=rec.schedule, status="ok", latency_us=rec.latency_us * 10, device="mine")
        user.add(mine)
        view = TunedRecords(user)
        got, origin = view.best(rec.workload_key, rec.target_key)
        assert got.device == "mine" and origin == str(user.path)  # slower, but the user's own
        got, origin = view.best(other.workload_key, other.target_key)
        assert got == other and origin == ORIGIN
        union = dict(((r.workload_key, o) for r, o in view.best_all("cuda:sm_90/h200")))
        assert union[rec.workload_key] == str(user.path) and union[other.workload_key] == ORIGIN
        assert TunedRecords(user, use_shipped=False).best(other.workload_key, other.target_key) is None


def test_select_keeps_the_fastest_ok_record_per_workload_and_timing():
    wl = workload("rmsnorm", M=3, N=64, dtype="fp32")
    def rec(lat, status="ok", extra=None):
        return Record(workload_key=wl.key, workload=wl.to_json(), target_key="cpu/host",
                      schedule={"block_r": 1, "block_c": 64, "num_warps": 1, "x": lat}, status=status,
                      latency_us=lat, device="d", extra=extra or {})
    behind = {"timing": "behind", "behind": {"op": "rmsnorm"}}
    chosen = select([rec(5.0), rec(3.0), rec(1.0, "wrong_result"), rec(4.0, extra=behind), rec(2.0, extra=behind)])
    assert sorted((r.timing, r.latency_us) for r in chosen) == [("alone", 3.0), ("behind", 2.0)]


def test_compile_serves_shipped_records_unless_turned_off(capsys, tmp_path, monkeypatch):
    rec = next(r for r in shipped_database().best_all("cuda:sm_90/h200") if r.workload["op"] == "rmsnorm")
    dims = [a for k, v in rec.workload["dims"].items() for a in ("--dim", f"{k}={v}")]
    argv = ["compile", "rmsnorm", *dims, "--dtype", rec.workload["attrs"]["dtype"], "--target", "h200"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert ORIGIN in out and json.dumps(rec.schedule, sort_keys=True) in out
    monkeypatch.setenv("FLASHGEN_SHIPPED", "0")
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert "analytic default" in capsys.readouterr().out


def test_db_list_shipped(capsys):
    assert main(["db", "best", "--shipped", "--target", "cuda:sm_90/h200"]) == 0
    out = capsys.readouterr().out
    assert "cuda:sm_90/h200" in out and "rmsnorm" in out
    assert main(["db", "list", "--shipped", "--db", "x.db"]) == 2
    assert "takes no --db" in capsys.readouterr().err


def test_dispatch_serves_shipped_records_exactly_and_as_buckets(tmp_path):
    from flashgen.runtime.dispatch import Dispatcher
    rec = next(r for r in shipped_database().best_all("cuda:sm_90/h200") if r.workload["op"] == "rmsnorm")
    wl = recorded_workload(rec.workload, rec.workload_key)
    target = get_target("h200")
    d = Dispatcher(target, tmp_path / "none.db").choose(wl, target)  # no user database at all
    assert d.source == "exact from shipped records" and d.schedule == rec.schedule and d.kind == "exact"
    near = wl.with_dims(M=wl.dim["M"] + 1)
    assert Dispatcher(target, tmp_path / "none.db").choose(near, target).kind == "bucket"
    with Database(tmp_path / "u.db") as user:
        user.add(Record(workload_key=rec.workload_key, workload=rec.workload, target_key=rec.target_key,
                        schedule=ScheduleSpace(wl, target).default(), status="ok", latency_us=99.0, device="mine"))
    d = Dispatcher(target, tmp_path / "u.db").choose(wl, target)
    assert d.source == "exact" and d.schedule == ScheduleSpace(wl, target).default()
