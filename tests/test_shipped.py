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


def _damage(folder, damage):
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


@pytest.mark.parametrize("damage, why", [("flip", "failed its sha256 check"), ("truncate", "failed its sha256 check"),
                                         ("empty", "failed its sha256 check"), ("manifest", "missing or unreadable")])
def test_a_damaged_shipped_file_is_not_served(tmp_path, monkeypatch, damage, why):
    folder = _copy(tmp_path)
    _damage(folder, damage)
    records, problems = shipped_mod._read_verified(folder)
    assert records == [] and len(problems) == 1 and why in problems[0], problems
    monkeypatch.setattr(shipped_mod, "SHIPPED_DIR", folder)
    with pytest.warns(UserWarning, match=f"shipped records not served: .*{why}"):
        assert shipped_database() is None


def test_db_list_shipped_says_the_file_failed_its_sha256_check(tmp_path, monkeypatch, capsys):
    """A tampered file was blamed on FLASHGEN_SHIPPED=0 or on none being installed, with exit 0."""
    folder = _copy(tmp_path)
    _damage(folder, "flip")
    monkeypatch.setattr(shipped_mod, "SHIPPED_DIR", folder)
    assert main(["db", "list", "--shipped"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert f"{folder / 'h200.jsonl'} failed its sha256 check against MANIFEST.json" in err, err
    assert "FLASHGEN_SHIPPED" not in err


def _rewrite(folder, change):
    """`change(record JSON)` applied to every line of the shipped H200 file, the manifest's sha256 made to
    match (what a maintainer's careless edit, not a damaged download, would give)."""
    path = folder / "h200.jsonl"
    lines = [json.dumps(change(json.loads(line)), sort_keys=True) for line in path.read_text().splitlines()]
    path.write_text("".join(line + "\n" for line in lines))
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    manifest["files"]["h200.jsonl"]["sha256"] = shipped_mod._sha256(path.read_bytes())
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))


def test_a_shipped_record_whose_workload_is_not_its_key_is_not_served(tmp_path, monkeypatch):
    rec = next(r for r in shipped_database().best_all("cuda:sm_90/h200") if r.workload["op"] == "rmsnorm")
    wl = recorded_workload(rec.workload, rec.workload_key)
    other = wl.with_dims(N=wl.dim["N"] + 8).to_json()  # another workload, under rec's key

    def change(line):
        return {**line, "workload": other} if line["workload_key"] == rec.workload_key else line
    folder = _copy(tmp_path)
    _rewrite(folder, change)
    records, problems = shipped_mod._read_verified(folder)
    assert records and all(r.workload_key != rec.workload_key for r in records)
    assert len(problems) == 1 and "whose workload is not the one their key names" in problems[0], problems
    assert rec.workload_key in problems[0]
    monkeypatch.setattr(shipped_mod, "SHIPPED_DIR", folder)
    from flashgen.runtime.serving.dispatch import Dispatcher
    target = get_target("h200")
    with pytest.warns(UserWarning, match="whose workload is not the one their key names"):
        d = Dispatcher(target, tmp_path / "none.db").choose(wl, target)
    assert d.kind != "exact", d


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), ("FALSE", False), ("no", False), ("Off", False),
                                       ("1", True), ("true", True), ("Yes", True), ("ON", True), ("", True)])
def test_flashgen_shipped_reads_the_usual_words(monkeypatch, value, on):
    """FLASHGEN_SHIPPED=false (no, off) left the shipped records on: only "0" turned them off."""
    monkeypatch.setenv("FLASHGEN_SHIPPED", value)
    assert (shipped_database() is not None) == on


@pytest.mark.parametrize("value", ["flase", "2", "disabled"])
def test_flashgen_shipped_refuses_other_values_in_one_line(monkeypatch, capsys, value):
    monkeypatch.setenv("FLASHGEN_SHIPPED", value)
    assert main(["db", "best", "--shipped"]) == 2
    err = capsys.readouterr().err
    assert err == f"flashgen: error: FLASHGEN_SHIPPED={value!r} is neither on (1/true/yes/on) nor off (0/false/no/off)\n"


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


def test_db_list_shipped(capsys, monkeypatch):
    assert main(["db", "best", "--shipped", "--target", "cuda:sm_90/h200"]) == 0
    out = capsys.readouterr().out
    assert "cuda:sm_90/h200" in out and "rmsnorm" in out
    assert main(["db", "list", "--shipped", "--db", "x.db"]) == 2
    assert "takes no --db" in capsys.readouterr().err
    monkeypatch.setenv("FLASHGEN_SHIPPED", "off")
    assert main(["db", "list", "--shipped"]) == 0
    assert capsys.readouterr().out == "no shipped records: FLASHGEN_SHIPPED=off turns them off\n"


def _best_rows(out: str) -> list[tuple[str, str, str]]:
    """(target, workload key, from) of each row `db best` prints (its last two columns are the key and
    where the record comes from; none of the columns before the timing holds a space)."""
    lines = out.splitlines()
    assert lines and lines[0].split()[-2:] == ["workload_key", "from"], out
    return [(line.split()[2], line.split()[-2], line.split()[-1]) for line in lines[1:] if not line.startswith("(")]


def test_db_best_on_a_fresh_install_shows_the_shipped_records_dispatch_serves(tmp_path, monkeypatch, capsys):
    """With no database yet (or an empty one), `db best --target h200` said no tuning database (or no
    records) while dispatch served every shipped H200 record."""
    h200 = {r.workload_key for r in shipped_database().best_all("cuda:sm_90/h200")}
    monkeypatch.setenv("FLASHGEN_DB", str(tmp_path / "none.db"))
    assert main(["db", "best", "--target", "h200"]) == 0
    rows = _best_rows(capsys.readouterr().out)
    assert {k for _, k, _ in rows} == h200 and len(rows) == len(h200)
    assert {(t, o) for t, _, o in rows} == {("cuda:sm_90/h200", "shipped")}
    Database(tmp_path / "none.db").close()  # an empty database: the shipped records still fill in
    assert main(["db", "best", "--target", "h200"]) == 0
    assert len(_best_rows(capsys.readouterr().out)) == len(h200)


def test_db_best_shows_what_compile_takes_user_shipped_and_other_device(tmp_path, monkeypatch, capsys):
    """The user's record where there is one, else the shipped one, else (an H100) the H200's: the same
    chain compile's schedule choice walks."""
    from flashgen.compiler import choose_schedule
    shipped = shipped_database().best_all("cuda:sm_90/h200")
    rec = next(r for r in shipped if r.workload["op"] == "rmsnorm")
    wl = recorded_workload(rec.workload, rec.workload_key)
    with Database(tmp_path / "u.db") as user:
        user.add(Record(workload_key=rec.workload_key, workload=rec.workload, target_key=rec.target_key,
                        schedule=ScheduleSpace(wl, get_target("h200")).default(), status="ok", latency_us=99.0,
                        device="mine"))
    for name in ("h200", "h100"):
        assert main(["db", "best", "--target", name, "--db", str(tmp_path / "u.db")]) == 0
        out = capsys.readouterr().out
        rows = {k: (t, o) for t, k, o in _best_rows(out)}
        assert rows[rec.workload_key] == ("cuda:sm_90/h200", "database")
        assert len(rows) == len({r.workload_key for r in shipped})
        assert all(o == "shipped" for k, (_, o) in rows.items() if k != rec.workload_key)
        assert ("records of another device of the architecture" in out) == (name == "h100"), out
        target = get_target(name)
        schedule, source = choose_schedule(wl, target, tmp_path / "u.db", None)
        assert schedule == ScheduleSpace(wl, target).default() and str(tmp_path / "u.db") in source


def test_dispatch_serves_shipped_records_exactly_and_as_buckets(tmp_path):
    from flashgen.runtime.serving.dispatch import Dispatcher
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


def test_shipped_gemv_records_never_serve_several_rows(tmp_path, capsys):
    """The W4A16 qkv GEMM of Llama-3-8B at 2-16 rows on an H100 has only the H200's M=1 bf16 records in
    its own dtype, one-row GEMV tiles: dispatch serves the fp16 M=16 matrix tile instead (never a tile of
    fewer rows than the call, which would read the weight once per row tile), and says what it skipped."""
    from flashgen.runtime.serving.dispatch import Dispatcher
    from flashgen.schedules.contraction_space import flat_of
    target, db = get_target("h100"), tmp_path / "empty.db"
    Database(db).close()  # a user database of no records: the shipped ones serve
    for m in range(1, 17):
        wl = workload("gemm_w4a16", M=m, N=6144, K=4096, G=128, dtype="bf16")
        d = Dispatcher(target, db).choose(wl, target)
        block_m = flat_of(wl, ScheduleSpace(wl, target).complete(d.schedule))["block_m"]
        assert block_m >= m, (m, d)
        if m > 1:
            assert d.kind == "other-device record" and d.source.startswith("bucket M=16, tuned in fp16")
            assert d.source.endswith(f"(bucket M=1, tuned on cuda:sm_90/h200 skipped: a GEMV tile of 1 row "
                                     f"cannot serve {m} rows)")
    assert main(["explain", "gemm_w4a16", "--dim", "M=16", "--dim", "N=6144", "--dim", "K=4096", "--dim", "G=128",
                 "--dtype", "bf16", "--target", "h100", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert '"block_m": 16' in out and "skipped: a GEMV tile of 1 row cannot serve 16 rows" in out
