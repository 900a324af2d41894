"""The tuning-log database: round trips, concurrency, refusing foreign files, best-of queries, CLI."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import multiprocessing
import multiprocessing.synchronize
import os
import sqlite3
from pathlib import Path

import pytest

from flashgen.db import STATUSES, Database, Record, default_db_path
from flashgen.db import cli
from flashgen.errors import FlashgenError

WORKLOAD = {"op": "rmsnorm", "dims": {"M": 128, "N": 4096}, "dtype": "float16"}


def make(latency: float | None = 10.0, status: str = "ok", workload_key: str = "wk-rmsnorm",
         target_key: str = "sm_90", **schedule: int) -> Record:
    return Record(workload_key=workload_key, workload=WORKLOAD, target_key=target_key,
                  schedule=schedule or {"block": 128}, status=status, latency_us=latency,
                  spread_us=None if latency is None else latency / 10, device="cpu",
                  extra={"repeats": 20})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_refused_untouched(path: Path, match: str) -> None:
    """Opening `path` as a database fails with `match`, and the file's bytes are unchanged."""
    before = sha256(path)
    with pytest.raises(FlashgenError, match=match):
        Database(path)
    assert sha256(path) == before


def _add_worker(path: str, worker: int, start: multiprocessing.synchronize.Barrier) -> None:
    start.wait()  # all four create the file and write at the same moment
    with Database(path) as db:
        for i in range(250):
            assert db.add(make(float(i + 1), block=worker * 1000 + i))


# --- Record -------------------------------------------------------------------------------------

def test_record_json_round_trip_and_keys() -> None:
    record = make(12.5, block=64, warps=4)
    again = Record.from_json(json.loads(json.dumps(record.to_json())))
    assert again == record
    assert again.content_hash == record.content_hash
    assert record.schedule_key == make(99.0, warps=4, block=64).schedule_key  # key order irrelevant
    assert record.schedule_key != make(12.5, block=32, warps=4).schedule_key
    assert len(record.schedule_key) == 16
    assert record.flashgen_version == "0.1.0"
    assert record.created_at.endswith("+00:00")


@pytest.mark.parametrize("field", ["workload_key", "schedule", "status", "device", "created_at"])
def test_record_from_json_names_missing_field(field: str) -> None:
    data = make().to_json()
    del data[field]
    with pytest.raises(FlashgenError, match=f"missing field '{field}'"):
        Record.from_json(data)


def test_record_validation() -> None:
    with pytest.raises(FlashgenError, match="'status' must be one of"):
        make(status="fast")
    with pytest.raises(FlashgenError, match="'latency_us' must be a latency above 0 us when status is 'ok', got None"):
        make(latency=None)
    with pytest.raises(FlashgenError, match="'latency_us' must be a latency above 0 us when status is 'ok', got 0.0"):
        make(latency=0.0)  # it measured nothing, and would rank first
    with pytest.raises(FlashgenError, match="'latency_us' must be a finite number"):
        make(latency=float("nan"))
    with pytest.raises(FlashgenError, match="'latency_us' must be a finite number"):
        Record.from_json({**make().to_json(), "latency_us": "fast"})
    with pytest.raises(FlashgenError, match="unknown field 'colour'"):
        Record.from_json({**make().to_json(), "colour": "red"})
    assert make(latency=None, status="crash").latency_us is None
    assert set(STATUSES) == {"ok", "wrong_result", "compile_error", "timeout", "crash"}


# --- Database -----------------------------------------------------------------------------------

def test_new_database_layout(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "tuning.db"
    with Database(path) as db:
        assert db.count() == 0
    conn = sqlite3.connect(path)
    assert dict(conn.execute("SELECT key, value FROM meta")) == {
        "format": "flashgen-tuning-db", "schema_version": "1"}
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_default_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASHGEN_DB", raising=False)
    monkeypatch.delenv("FLASHGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_db_path() == tmp_path / "cache" / "flashgen" / "tuning.db"
    monkeypatch.setenv("FLASHGEN_DB", str(tmp_path / "env.db"))
    with Database() as db:
        db.add(make())
    assert (tmp_path / "env.db").stat().st_size > 0


def test_add_skips_exact_duplicates(tmp_path: Path) -> None:
    with Database(tmp_path / "t.db") as db:
        record, second, third = make(), make(11.0), make(11.0, block=7)
        assert db.add(record) is True
        assert db.add(record) is False
        assert db.add_many([record, second, third, second]) == 2
        assert db.count() == 3
        assert db.records() == [record, second, third]  # insertion order


def test_best_ignores_faster_failures(tmp_path: Path) -> None:
    with Database(tmp_path / "t.db") as db:
        db.add_many([
            make(30.0, block=1),
            make(12.0, block=2),
            make(1.0, status="wrong_result", block=3),
            make(0.5, status="timeout", block=4),
            make(None, status="crash", block=5),
            make(20.0, block=6),
            make(5.0, block=7, target_key="gfx942"),
            make(8.0, block=8, workload_key="wk-other"),
            make(2.0, block=9, workload_key="wk-other"),
        ])
        assert db.best("wk-rmsnorm", "sm_90").schedule == {"block": 2}
        assert db.best("wk-rmsnorm", "sm_75") is None
        assert [(r.workload_key, r.target_key, r.schedule["block"]) for r in db.best_all()] == [
            ("wk-other", "sm_90", 9), ("wk-rmsnorm", "gfx942", 7), ("wk-rmsnorm", "sm_90", 2)]
        assert [r.schedule["block"] for r in db.best_all("gfx942")] == [7]
        not_2_nor_7 = lambda rec: rec.schedule["block"] not in (2, 7)  # noqa: E731
        assert db.best("wk-rmsnorm", "sm_90", not_2_nor_7).schedule == {"block": 6}  # the next, in best's order
        assert [(r.workload_key, r.target_key, r.schedule["block"]) for r in db.best_all(usable=not_2_nor_7)] == [
            ("wk-other", "sm_90", 9), ("wk-rmsnorm", "sm_90", 6)]  # gfx942 has no other: not listed
        assert db.measured_schedule_keys("wk-rmsnorm", "sm_90") == {
            make(block=b).schedule_key for b in (1, 2, 3, 4, 5, 6)}
        assert [r.schedule["block"] for r in db.records(status="timeout")] == [4]
        assert len(db.records(workload_key="wk-other", target_key="sm_90")) == 2


def test_best_prefers_records_timed_behind_a_producer(tmp_path: Path) -> None:
    """Latencies timed behind a producer compete only with each other: a workload that has any is served
    its fastest such record, even where a record timed alone reads faster; others keep their best alone."""
    behind = {"timing": "behind", "behind": {"op": "gemm", "dims": {}, "attrs": {}}}
    with Database(tmp_path / "t.db") as db:
        db.add_many([make(10.0, block=1), make(9.0, block=2),
                     dataclasses.replace(make(12.0, block=3), extra=behind),
                     dataclasses.replace(make(11.0, block=4), extra=behind),
                     dataclasses.replace(make(1.0, status="crash", block=5), extra=behind),
                     make(7.0, block=6, workload_key="wk-other")])
        best = db.best("wk-rmsnorm", "sm_90")
        assert best.schedule == {"block": 4} and best.timing == "behind"
        assert [(r.workload_key, r.schedule["block"], r.timing) for r in db.best_all("sm_90")] == [
            ("wk-other", 6, "alone"), ("wk-rmsnorm", 4, "behind")]
        assert make().timing == "alone"


def test_export_import_round_trip(tmp_path: Path) -> None:
    records = [make(float(i), block=i) for i in range(1, 6)] + [make(None, status="crash", block=99)]
    with Database(tmp_path / "a.db") as db:
        db.add_many(records)
        assert db.export_jsonl(tmp_path / "log.jsonl") == 6
    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    assert [Record.from_json(json.loads(line)) for line in lines] == records
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    with Database(tmp_path / "a.db") as db, pytest.raises(FlashgenError, match="cannot write"):
        db.export_jsonl(tmp_path / "missing-dir" / "log.jsonl")
    with Database(tmp_path / "b.db") as db:
        assert db.import_jsonl(tmp_path / "log.jsonl") == (6, 0)
        assert db.records() == records
        assert db.import_jsonl(tmp_path / "log.jsonl") == (0, 6)
        assert db.count() == 6


def test_malformed_jsonl_adds_nothing(tmp_path: Path) -> None:
    good = json.dumps(make(1.0).to_json())
    log = tmp_path / "bad.jsonl"
    with Database(tmp_path / "t.db") as db:
        db.add(make(50.0, block=50))
        log.write_text(f"{good}\n{{not json\n")
        with pytest.raises(FlashgenError, match=r"bad\.jsonl:2: invalid JSON"):
            db.import_jsonl(log)
        incomplete = make(2.0, block=2).to_json()
        del incomplete["target_key"]
        log.write_text(f"{good}\n\n{json.dumps(incomplete)}\n")
        with pytest.raises(FlashgenError, match=r"bad\.jsonl:3: record is missing field 'target_key'"):
            db.import_jsonl(log)
        assert db.count() == 1
        with pytest.raises(FlashgenError, match="cannot read"):
            db.import_jsonl(tmp_path / "absent.jsonl")


def test_corrupt_file_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "random.db"
    path.write_bytes(os.urandom(8192))
    assert_refused_untouched(path, "is not a flashgen tuning database .*pass another --db")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["random.db"]


def test_corrupt_file_with_sqlite_header_is_refused_untouched(tmp_path: Path) -> None:
    path = tmp_path / "torn.db"
    path.write_bytes(b"SQLite format 3\x00" + os.urandom(8192))
    assert_refused_untouched(path, "is not a flashgen tuning database")


@pytest.mark.parametrize("journal_mode", ["delete", "wal"])
def test_other_apps_sqlite_is_refused_untouched(tmp_path: Path, journal_mode: str) -> None:
    path = tmp_path / "app.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA journal_mode={journal_mode}")
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.execute("INSERT INTO users VALUES ('ada')")
    conn.commit()
    conn.close()
    assert_refused_untouched(path, "no flashgen meta table.*pass another --db path")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.sqlite"]


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "future.db"
    Database(path).close()
    conn = sqlite3.connect(path)
    conn.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    assert_refused_untouched(path, r"newer flashgen \(schema v7, this one reads up to v1\)")


def test_reopening_creates_no_side_files(tmp_path: Path) -> None:
    path = tmp_path / "t.db"
    with Database(path) as db:
        db.add(make())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.db"]
    with Database(path) as db:
        assert db.count() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.db"]


def test_empty_file_becomes_database(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    path.touch()
    with Database(path) as db:
        assert db.add(make())
    with Database(path) as db:
        assert db.count() == 1


def test_concurrent_writers_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.db")  # created by the racing workers themselves
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(4)
    workers = [ctx.Process(target=_add_worker, args=(path, w, start)) for w in range(4)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=120)
    assert [p.exitcode for p in workers] == [0, 0, 0, 0]
    with Database(path) as db:
        assert db.count() == 1000
        assert len({r.schedule_key for r in db.records()}) == 1000


# --- CLI ----------------------------------------------------------------------------------------

H200 = "cuda:sm_90/h200"


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="flashgen")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def rows(block_c: int) -> dict[str, int]:
    """A rowwise schedule today's space accepts for WORKLOAD on H200 and mi300x (`db best` serves no other)."""
    return {"block_c": block_c, "block_r": 1, "num_warps": 1}


def test_cli_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db_path, other, log = str(tmp_path / "a.db"), str(tmp_path / "b.db"), str(tmp_path / "log.jsonl")
    with Database(db_path) as db:
        db.add_many([make(9.0, target_key=H200, **rows(256)), make(4.25, target_key=H200, **rows(512)),
                     make(1.0, status="wrong_result", target_key=H200, **rows(1024)),
                     make(7.0, target_key="rocm:gfx942/mi300x", **rows(2048))])

    assert run_cli(["db", "list", "--db", db_path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["op", "dims", "target", "status", "latency_us", "spread_us", "timing",
                                "schedule", "workload_key"]
    assert len(lines) == 5
    assert lines[1].split() == ["rmsnorm", "M=128,N=4096", H200, "ok", "9.00", "0.90", "alone",
                                '{"block_c":256,"block_r":1,"num_warps":1}', "wk-rmsnorm"]
    assert lines[3].split()[3:5] == ["wrong_result", "1.00"]

    assert run_cli(["db", "list", "--db", db_path, "--target", "sm_90", "--status", "ok",
                    "--limit", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "9.00" in lines[1] and lines[2] == "(1 of 2 records shown)"

    assert run_cli(["db", "best", "--db", db_path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2:5] for line in lines[1:]] == [[H200, "ok", "4.25"],
                                                         ["rocm:gfx942/mi300x", "ok", "7.00"]]

    assert run_cli(["db", "export", log, "--db", db_path]) == 0
    assert capsys.readouterr().out.startswith(f"exported 4 records from {db_path} to {log}")
    assert len(Path(log).read_text().splitlines()) == 4
    Path(log).write_text(_good_line() + "\n" + _good_line(latency_us=3.0) + "\n")  # records import accepts
    assert run_cli(["db", "import", log, "--db", other]) == 0
    assert "imported 2 new records" in capsys.readouterr().out
    assert run_cli(["db", "import", log, "--db", other]) == 0
    out = capsys.readouterr().out
    assert "imported 0 new records" in out and "(2 duplicates skipped)" in out

    assert run_cli(["db", "best", "--db", other, "--target", "mi300x"]) == 0
    assert capsys.readouterr().out == "no records\n"


def test_cli_long_schedule_is_shortened(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db_path = str(tmp_path / "a.db")
    with Database(db_path) as db:
        db.add(make(3.0, **{f"knob_{i}": i for i in range(20)}))
    run_cli(["db", "list", "--db", db_path])
    row = capsys.readouterr().out.splitlines()[1]
    assert '{"knob_0":0,' in row and "..." in row and "knob_19" not in row


def test_cli_refuses_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello\n")
    with pytest.raises(FlashgenError, match="notes.txt is not a flashgen tuning database"):
        run_cli(["db", "list", "--db", str(path)])
    assert path.read_text() == "hello\n"


# ---- refusing what would break readers (import), and reading whatever is stored ----------------------

def _good_line(**change):
    import flashgen
    wl = flashgen.workload("rmsnorm", M=3, N=64, dtype="fp32")
    rec = {"workload_key": wl.key, "workload": wl.to_json(), "target_key": "cpu/host",
           "schedule": {"block_r": 1, "block_c": 64, "num_warps": 1}, "status": "ok", "latency_us": 2.5,
           "spread_us": 0.1, "flashgen_version": "0.1.0", "device": "cpu", "created_at": "2026-12-01T00:00:00+00:00",
           "extra": {}}
    for k, v in change.items():
        if k in ("dims", "attrs"):
            rec["workload"] = {**rec["workload"], k: v}
        else:
            rec[k] = v
    return json.dumps(rec)


@pytest.mark.parametrize("bad, message", [
    (_good_line(schedule={"block_r": "1", "block_c": 64, "num_warps": 1}), "knobs must be integers"),
    (_good_line(schedule={"block_r": True, "block_c": 64, "num_warps": 1}), "knobs must be integers"),
    (_good_line(schedule={"block_r": 1, "block_c": 64, "num_warps": 1, "warp_magic": 2}),
     r"schedule names knobs the rowwise space on cpu/host does not have: warp_magic"),
    (_good_line(dims={"M": 3}), "missing dim N"),
    (_good_line(dims={"M": 3, "N": -64}), "must be positive"),
    (_good_line(dims={"M": 3, "N": 10 ** 12}), "absurd"),
    (_good_line(dims={"M": 3, "N": "64"}), "dims must be integers"),
    (_good_line(workload_key="rmsnorm-0000000000000000"), "is not the key of its workload"),
    (_good_line(latency_us=0.0), "latency above 0"),
    (_good_line(target_key="cpu"), r"target_key 'cpu' is a name, not a target id: .*reaches cpu/host"),
    (_good_line(target_key="CPU/Host"), r"target_key 'CPU/Host' is a name, not a target id"),
    (_good_line(target_key="h200"), r"target_key 'h200' is a name, not a target id: .*reaches cuda:sm_90/h200"),
    (_good_line(workload={"op": "no_such_op", "dims": {}, "attrs": {}}), "workload"),
    ('{"a": ' * 100000 + "1" + "}" * 100000, "nested too deep"),
    ('{"n": 1' + "0" * 5000 + "}", "numbers too large"),
    (b'{"workload_key": "\xff\xfe"}', "not UTF-8"),
    (_good_line(device="cpu\ud800"), r"record holds '\\ud800', a lone surrogate, which is not text"),
    (_good_line(schedule={"block_r": 1, "block_c": 64, "num_warps": 1, "\udfff": 2}), "a lone surrogate"),
])
def test_import_refuses_a_bad_record_by_line_and_stores_nothing(tmp_path, bad, message):
    from flashgen.schedules.record_check import record_problem
    path = tmp_path / "in.jsonl"
    good = _good_line().encode()
    path.write_bytes(good + b"\n" + (bad if isinstance(bad, bytes) else bad.encode()) + b"\n")
    with Database(tmp_path / "t.db") as db:
        with pytest.raises(FlashgenError, match=f"in.jsonl:2: .*{message}") as e:
            db.import_jsonl(path, check=record_problem)
        assert db.count() == 0 and "\n" not in str(e.value)


def test_the_cli_import_checks_records(tmp_path, capsys):
    from flashgen.cli import main
    (tmp_path / "in.jsonl").write_text(_good_line(schedule={"block_r": "x", "block_c": 64, "num_warps": 1}) + "\n")
    assert main(["db", "import", str(tmp_path / "in.jsonl"), "--db", str(tmp_path / "t.db")]) == 2
    assert "in.jsonl:1" in capsys.readouterr().err


def test_the_cli_import_of_a_lone_surrogate_is_one_line_and_imports_nothing(tmp_path, capsys):
    """The JSON escape "\\ud800" is valid JSON, and its string is no text a UTF-8 database can store."""
    from flashgen.cli import main
    path = tmp_path / "in.jsonl"
    path.write_text(_good_line() + "\n" + _good_line(device="cpu\ud800", latency_us=3.0) + "\n")
    assert "\\ud800" in path.read_text()
    assert main(["db", "import", str(path), "--db", str(tmp_path / "t.db")]) == 2
    assert capsys.readouterr().err == (f"flashgen: error: {path}:2: record holds '\\ud800', a lone surrogate, which "
                                       "is not text; fix or remove the line, nothing was imported.\n")
    with Database(tmp_path / "t.db") as db:
        assert db.count() == 0


def test_rows_that_no_longer_parse_are_skipped_with_a_warning(tmp_path, capsys):
    import sqlite3
    from flashgen.cli import main
    path = tmp_path / "t.db"
    (tmp_path / "in.jsonl").write_text(_good_line() + "\n" + _good_line(latency_us=3.5) + "\n")
    with Database(path) as db:
        db.import_jsonl(tmp_path / "in.jsonl")
    conn = sqlite3.connect(path)
    conn.execute("UPDATE records SET schedule_json = '{broken' WHERE latency_us = 2.5")
    conn.commit()
    conn.close()
    with pytest.warns(UserWarning, match="skipped 1 stored record"):
        assert main(["db", "list", "--db", str(path)]) == 0
    assert "3.50" in capsys.readouterr().out
    with pytest.warns(UserWarning):
        assert main(["db", "export", "--db", str(path), str(tmp_path / "out.jsonl")]) == 0
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1


def test_import_keeps_schedules_older_rules_allowed_and_says_so(tmp_path, capsys):
    """A record measured under rules since changed (a knob value dropped) is stored and counted, and
    dispatch never serves it."""
    import flashgen
    from flashgen.cli import main
    stale = _good_line(schedule={"block_r": 1, "block_c": 64, "num_warps": 3}, latency_us=0.5)
    (tmp_path / "in.jsonl").write_text(_good_line() + "\n" + stale + "\n")
    assert main(["db", "import", str(tmp_path / "in.jsonl"), "--db", str(tmp_path / "t.db")]) == 0
    out = capsys.readouterr().out
    assert "imported 2 new records" in out
    assert "1 of the file's records have schedules today's space refuses (first: num_warps=3 is not one of" in out
    with Database(tmp_path / "t.db") as db:
        rec = json.loads(_good_line())
        wl = flashgen.Workload.from_json(rec["workload"])
        assert flashgen.compile(wl, "cpu", db=db).schedule["num_warps"] != 3


def test_import_keeps_records_of_a_target_this_install_does_not_know(tmp_path):
    from flashgen.schedules.record_check import record_problem
    path = tmp_path / "in.jsonl"
    path.write_text(_good_line(target_key="tpu:v5/lite", schedule={"any_knob": 1}) + "\n")
    with Database(tmp_path / "t.db") as db:
        assert db.import_jsonl(path, check=record_problem) == (1, 0)


@pytest.mark.parametrize("damage, params, why", [
    ("latency_us = -1.0", (), "must be a finite number >= 0 or null, got -1.0"),
    ("latency_us = ?", (float("nan"),), "above 0 us when status is 'ok', got None"),  # SQLite keeps NaN as NULL
    ("latency_us = 0.0", (), "above 0 us when status is 'ok', got 0.0"),
    ("schedule_json = '{broken'", (), "JSONDecodeError: Expecting property name"),
    ("latency_us = 1.0", (), "no longer hash to the content hash written with them"),  # valid, but edited
    ("schedule_json = '{\"block\": 9, \"warps\": 4}'", (), "no longer hash to the content hash"),
], ids=["negative", "nan", "zero", "json", "edited-latency", "edited-schedule"])
def test_a_damaged_row_is_reported_never_served_and_hides_no_best(tmp_path, capsys, damage, params, why):
    import re
    path = tmp_path / "t.db"
    with Database(path) as db:
        db.add_many([make(5.0, block=1), make(7.0, block=2)])
    conn = sqlite3.connect(path)
    conn.execute(f"UPDATE records SET {damage} WHERE id = 1", params)  # the faster one, first in best's order
    conn.commit()
    conn.close()
    warned = f"skipped 1 stored record.*never served .*row id 1: .*{re.escape(why)}"
    with Database(path, readonly=True) as db:
        for read in (db.best_all, lambda: [db.best("wk-rmsnorm", "sm_90")], lambda: db.ranked("wk-rmsnorm", "sm_90")):
            with pytest.warns(UserWarning, match=warned):
                assert [r.latency_us for r in read()] == [7.0]
    with pytest.warns(UserWarning, match=warned):
        assert run_cli(["db", "best", "--db", str(path)]) == 0
    assert [line.split()[4] for line in capsys.readouterr().out.splitlines()[1:]] == ["7.00"]


def test_read_commands_create_nothing(tmp_path, capsys):
    from flashgen.cli import main
    for cmd in (["db", "list"], ["db", "best"], ["db", "export", str(tmp_path / "e.jsonl")]):
        assert main([*cmd, "--db", str(tmp_path / "typo" / "x.db")]) == 2
        assert "no tuning database" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()


def test_reading_opens_nothing_for_writing(tmp_path):
    path = tmp_path / "t.db"
    (tmp_path / "in.jsonl").write_text(_good_line() + "\n")
    with Database(path) as db:
        db.import_jsonl(tmp_path / "in.jsonl")
    before = sorted(p.name for p in tmp_path.iterdir())
    with Database(path, readonly=True) as db:
        assert db.count() == 1
        with pytest.raises(FlashgenError, match="for reading only"):
            db.add(db.records()[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("damage, message", [
    ("DROP TABLE records", "no records table"),
    ("UPDATE meta SET value = '-1' WHERE key = 'schema_version'", "schema_version is -1"),
])
def test_a_half_flashgen_file_is_refused(tmp_path, damage, message):
    import sqlite3
    path = tmp_path / "t.db"
    Database(path).close()
    conn = sqlite3.connect(path)
    conn.execute(damage)
    conn.commit()
    conn.close()
    for readonly in (False, True):
        with pytest.raises(FlashgenError, match=message):
            Database(path, readonly=readonly)


def test_export_never_overwrites_the_database_and_needs_force(tmp_path, capsys):
    from flashgen.cli import main
    path = tmp_path / "t.db"
    (tmp_path / "in.jsonl").write_text(_good_line() + "\n")
    assert main(["db", "import", str(tmp_path / "in.jsonl"), "--db", str(path)]) == 0
    assert main(["db", "export", "--db", str(path), str(path), "--force"]) == 2
    assert "being exported" in capsys.readouterr().err
    with Database(path, readonly=True) as db:
        assert db.count() == 1
    out = tmp_path / "o.jsonl"
    out.write_text("keep me\n")
    assert main(["db", "export", "--db", str(path), str(out)]) == 2
    assert "--force" in capsys.readouterr().err and out.read_text() == "keep me\n"
    assert main(["db", "export", "--db", str(path), str(out), "--force"]) == 0
    assert json.loads(out.read_text())["latency_us"] == 2.5


def test_export_to_a_folder_says_a_folder_is_never_replaced(tmp_path, capsys):
    """It suggested --force, which then failed naming the export's temporary file."""
    from flashgen.cli import main
    path = tmp_path / "t.db"
    (tmp_path / "in.jsonl").write_text(_good_line() + "\n")
    assert main(["db", "import", str(tmp_path / "in.jsonl"), "--db", str(path)]) == 0
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "kept").write_text("x")
    capsys.readouterr()
    for force in ([], ["--force"]):
        assert main(["db", "export", "--db", str(path), str(folder), *force]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (f"flashgen: error: {folder} is a folder, which an export never replaces; give a "
                                     f"file path, such as {folder / 'records.jsonl'}.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out", "t.db"]
    assert [p.name for p in folder.iterdir()] == ["kept"]


def test_db_target_takes_compile_names_and_refuses_unknown_ones(tmp_path, capsys):
    from flashgen.cli import main
    path = tmp_path / "t.db"
    (tmp_path / "in.jsonl").write_text(_good_line() + "\n")
    assert main(["db", "import", str(tmp_path / "in.jsonl"), "--db", str(path)]) == 0
    capsys.readouterr()
    assert main(["db", "best", "--db", str(path), "--target", "cpu"]) == 0
    assert "cpu/host" in capsys.readouterr().out
    assert main(["db", "list", "--db", str(path), "--target", "h900"]) == 2
    assert "unknown target" in capsys.readouterr().err


def test_db_best_shows_what_dispatch_serves(tmp_path, capsys):
    """`db best` passes over records whose schedules today's space refuses, as dispatch does, shows the
    next valid one, and counts what it passed over (on the targets shown)."""
    import flashgen
    from flashgen.cli import main
    from flashgen.compiler import choose_schedule
    from flashgen.targets import get_target
    wl, other = (flashgen.workload("rmsnorm", M=m, N=64, dtype="fp32") for m in (3, 5))
    stale = {"block_r": 1, "block_c": 64, "num_warps": 3}  # num_warps=3: valid once, not today
    valid = {"block_r": 2, "block_c": 64, "num_warps": 1}
    renamed = {"op": "rmsnorm_v0", "dims": {"M": 3, "N": 64}, "attrs": {}}  # an op flashgen no longer has
    lines = [_good_line(latency_us=1.0, schedule=stale), _good_line(latency_us=2.0, schedule=valid),
             _good_line(latency_us=0.5, schedule=stale, dims={"M": 5, "N": 64}, workload_key=other.key),
             _good_line(latency_us=0.5, workload=renamed, workload_key="rmsnorm_v0-0")]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    path = tmp_path / "t.db"
    with Database(path) as db:
        db.import_jsonl(tmp_path / "in.jsonl")
    assert main(["db", "best", "--db", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [(row.split()[1], row.split()[4]) for row in out[1:-1]] == [("M=3,N=64", "2.00")]
    assert out[-1].startswith("(3 stale records passed over: today's space refuses their schedules, so dispatch "
                              "never serves them; first: num_warps=3 is not one of"), out[-1]
    assert choose_schedule(wl, get_target("cpu"), path, None)[0] == valid
    assert "database best" not in choose_schedule(other, get_target("cpu"), path, None)[1]
    assert main(["db", "best", "--db", str(path), "--target", "h200"]) == 0
    assert capsys.readouterr().out == "no records\n"


def test_compile_serves_the_best_record_whose_schedule_is_still_valid(tmp_path):
    import flashgen
    from flashgen.compiler import choose_schedule
    from flashgen.targets import get_target
    wl = flashgen.workload("rmsnorm", M=3, N=64, dtype="fp32")
    path = tmp_path / "t.db"
    lines = [_good_line(latency_us=1.0, schedule={"block_r": 1, "block_c": 64, "num_warps": 3}),  # not valid today
             _good_line(latency_us=2.0, schedule={"block_r": 2, "block_c": 64, "num_warps": 1})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    with Database(path) as db:
        db.import_jsonl(tmp_path / "in.jsonl")
    schedule, source = choose_schedule(wl, get_target("cpu"), path, None)
    assert schedule == {"block_r": 2, "block_c": 64, "num_warps": 1} and "database best" in source


def test_importing_one_devices_records_never_overwrites_anothers(tmp_path):
    """An H100 log holding the very records of an H200 log but for their device: both stay, each device's
    best is its own, and importing either again adds nothing."""
    from flashgen.workload import workload
    wl = workload("gemm", M=16, N=4096, K=4096, dtype="bf16")
    s1 = {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3, "group_m": 1}
    s2 = {**s1, "block_n": 128}
    made = "2026-12-01T00:00:00+00:00"
    h200 = [Record(workload_key=wl.key, workload=wl.to_json(), target_key="cuda:sm_90/h200", schedule=s, status="ok",
                   latency_us=lat, device="NVIDIA H200", created_at=made) for s, lat in ((s1, 5.0), (s2, 7.0))]
    h100 = [dataclasses.replace(r, target_key="cuda:sm_90/h100", device="NVIDIA H100 80GB HBM3",
                                latency_us=12.0 - r.latency_us) for r in h200]
    logs = {}
    for name, recs in (("h200", h200), ("h100", h100)):
        logs[name] = tmp_path / f"{name}.jsonl"
        logs[name].write_text("".join(json.dumps(r.to_json()) + "\n" for r in recs))
    with Database(tmp_path / "db.sqlite") as db:
        assert db.import_jsonl(logs["h200"]) == (2, 0)
        assert db.import_jsonl(logs["h100"]) == (2, 0)
        assert db.import_jsonl(logs["h200"]) == (0, 2) and db.import_jsonl(logs["h100"]) == (0, 2)
        assert sorted(r.latency_us for r in db.records(wl.key, "cuda:sm_90/h200")) == [5.0, 7.0]
        assert sorted(r.latency_us for r in db.records(wl.key, "cuda:sm_90/h100")) == [5.0, 7.0]
        assert db.best(wl.key, "cuda:sm_90/h200").schedule == s1 and db.best(wl.key, "cuda:sm_90/h100").schedule == s2
        assert {r.device for r in db.records(wl.key, "cuda:sm_90/h100")} == {"NVIDIA H100 80GB HBM3"}
