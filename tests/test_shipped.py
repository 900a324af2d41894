"""The tuned records that ship with flashgen: verified before use, valid in today's spaces, overridden
by the user's database, served by compile and listed by `flashgen db --shipped`."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from flashgen.cli import main
from flashgen.db import Database, Record
from flashgen.db import shipped as shipped_mod
from flashgen.db.shipped import ORIGIN, SHIPPED_DIR, TunedRecords, select, shipped_database
from flashgen.errors import FlashgenError
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets.descriptor import get_target
from flashgen.workload import recorded_workload, workload

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_FILES = json.loads((SHIPPED_DIR / "MANIFEST.json").read_text())["files"]  # name -> {records, sha256}


def _device(name: str) -> str:
    """The target key of the records a shipped file holds (`<device>.jsonl`)."""
    return get_target(name.removesuffix(".jsonl")).id


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
    """The shipped folder, every file the manifest lists and the manifest, where a test may damage it."""
    folder = tmp_path / "shipped"
    shutil.copytree(SHIPPED_DIR, folder)
    return folder


def _damage(folder, damage, name="h200.jsonl"):
    data = folder / name
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


@pytest.mark.parametrize("name", sorted(SHIPPED_FILES))
@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_shipped_file_is_not_served(tmp_path, monkeypatch, damage, name):
    """None of a damaged file's records is served; the other files the manifest lists still are."""
    folder = _copy(tmp_path)
    _damage(folder, damage, name)
    others = {n: e["records"] for n, e in SHIPPED_FILES.items() if n != name}
    records, problems = shipped_mod._read_verified(folder)
    assert len(problems) == 1 and f"{folder / name} failed its sha256 check" in problems[0], problems
    assert len(records) == sum(others.values()) and {r.target_key for r in records} == {_device(n) for n in others}
    monkeypatch.setattr(shipped_mod, "SHIPPED_DIR", folder)
    with pytest.warns(UserWarning, match=f"shipped records not served: .*{name} failed its sha256 check"):
        db = shipped_database()
    assert (db.count() if db is not None else 0) == sum(others.values())


def test_a_damaged_manifest_serves_no_shipped_file(tmp_path, monkeypatch):
    folder = _copy(tmp_path)
    _damage(folder, "manifest")
    records, problems = shipped_mod._read_verified(folder)
    assert records == [] and len(problems) == 1 and "missing or unreadable" in problems[0], problems
    monkeypatch.setattr(shipped_mod, "SHIPPED_DIR", folder)
    with pytest.warns(UserWarning, match="shipped records not served: .*missing or unreadable"):
        assert shipped_database() is None


def test_db_list_shipped_says_the_file_failed_its_sha256_check(tmp_path, monkeypatch, capsys):
    """A tampered file was blamed on FLASHGEN_SHIPPED=0 or on none being installed, with exit 0: with
    every shipped file tampered, one line names each and the exit is 2; with one, the others' records are
    listed and one warning line names it."""
    folder = _copy(tmp_path)
    for name in SHIPPED_FILES:
        _damage(folder, "flip", name)
    monkeypatch.setattr(shipped_mod, "SHIPPED_DIR", folder)
    assert main(["db", "list", "--shipped"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    for name in SHIPPED_FILES:
        assert f"{folder / name} failed its sha256 check against MANIFEST.json" in err, err
    assert "FLASHGEN_SHIPPED" not in err
    folder = _copy(tmp_path / "one")
    _damage(folder, "flip", "h200.jsonl")
    monkeypatch.setattr(shipped_mod, "SHIPPED_DIR", folder)
    assert main(["db", "list", "--shipped"]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and f"{folder / 'h200.jsonl'} failed its sha256 check against MANIFEST.json" in err
    targets = [line.split()[2] for line in out.splitlines()[1:]]
    others = {n: e["records"] for n, e in SHIPPED_FILES.items() if n != "h200.jsonl"}
    assert len(targets) == sum(others.values()) and set(targets) == {_device(n) for n in others}, out


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


def _shipped_keys(device: str) -> set[str]:
    """The workload keys `device` has shipped records of."""
    return {r.workload_key for r in shipped_database().best_all(get_target(device).id)}


def test_db_best_on_a_fresh_install_shows_the_shipped_records_dispatch_serves(tmp_path, monkeypatch, capsys):
    """With no database yet (or an empty one), `db best --target h200` said no tuning database (or no
    records) while dispatch served every shipped H200 record (and the H100's of workloads it has none of)."""
    h200 = _shipped_keys("h200")
    h100 = _shipped_keys("h100") - h200
    expected = {("cuda:sm_90/h200", k, "shipped") for k in h200} | {("cuda:sm_90/h100", k, "shipped") for k in h100}
    monkeypatch.setenv("FLASHGEN_DB", str(tmp_path / "none.db"))
    assert main(["db", "best", "--target", "h200"]) == 0
    out = capsys.readouterr().out
    rows = _best_rows(out)
    assert set(rows) == expected and len(rows) == len(expected)
    assert f"({len(h100)} records of another device of the architecture" in out, out
    Database(tmp_path / "none.db").close()  # an empty database: the shipped records still fill in
    assert main(["db", "best", "--target", "h200"]) == 0
    assert set(_best_rows(capsys.readouterr().out)) == expected


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
    own = {name: _shipped_keys(name) for name in ("h200", "h100")}
    assert own["h100"] - own["h200"] and rec.workload_key not in own["h100"]
    for name, other in (("h200", "h100"), ("h100", "h200")):
        assert main(["db", "best", "--target", name, "--db", str(tmp_path / "u.db")]) == 0
        out = capsys.readouterr().out
        rows = {k: (t, o) for t, k, o in _best_rows(out)}
        assert rows[rec.workload_key] == ("cuda:sm_90/h200", "database")
        assert set(rows) == own[name] | own[other]
        assert all(o == "shipped" for k, (_, o) in rows.items() if k != rec.workload_key)
        assert all(t == get_target(name).id for k, (t, _) in rows.items() if k in own[name])
        borrowed = own[other] - own[name]  # (on the H100, the user's H200 record among them)
        assert all(rows[k][0] == get_target(other).id for k in borrowed)
        assert f"({len(borrowed)} records of another device of the architecture" in out, out
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
    """The W4A16 8192x8192 GEMM (Llama-3-70B's o_proj) at 2-16 rows on an H100, which has no records of
    that shape of its own, has only the H200's M=1 bf16 records in its own dtype, one-row GEMV tiles:
    dispatch serves the fp16 M=16 matrix tile instead (never a tile of fewer rows than the call, which
    would read the weight once per row tile), and says what it skipped."""
    from flashgen.runtime.serving.dispatch import Dispatcher
    from flashgen.schedules.contraction_space import flat_of
    target, db = get_target("h100"), tmp_path / "empty.db"
    assert not any(r.workload["dims"]["N"] == r.workload["dims"]["K"] == 8192
                   for r in shipped_database().best_all(target.id) if r.workload["op"] == "gemm_w4a16")
    Database(db).close()  # a user database of no records: the shipped ones serve
    for m in range(1, 17):
        wl = workload("gemm_w4a16", M=m, N=8192, K=8192, G=128, dtype="bf16")
        d = Dispatcher(target, db).choose(wl, target)
        block_m = flat_of(wl, ScheduleSpace(wl, target).complete(d.schedule))["block_m"]
        assert block_m >= m, (m, d)
        if m > 1:
            assert d.kind == "other-device record" and d.source.startswith("bucket M=16, tuned in fp16")
        if 1 < m < 16:
            assert d.source.endswith(f"(bucket M=1, tuned on cuda:sm_90/h200 skipped: a GEMV tile of 1 row "
                                     f"cannot serve {m} rows)")
    # (at 16 rows the fp16 record is of the call's own rows, taken before any other row count is looked at)
    assert main(["explain", "gemm_w4a16", "--dim", "M=12", "--dim", "N=8192", "--dim", "K=8192", "--dim", "G=128",
                 "--dtype", "bf16", "--target", "h100", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert '"block_m": 16' in out and "skipped: a GEMV tile of 1 row cannot serve 12 rows" in out


def test_an_h100_serves_its_own_shipped_records_and_an_h200_the_h200s(tmp_path):
    """Each of the H100's shipped decode GEMMs is served on an H100 from its own record, exact, not
    from the H200's; an H200 serves Llama-3-8B's qkv GEMM at 16 rows from the H100's exact record before
    its own fp16 bucket (a record of the very workload first, whichever GPU of the architecture)."""
    from flashgen.runtime.serving.dispatch import Dispatcher
    shipped = shipped_database()
    h100, h200 = get_target("h100"), get_target("h200")
    own = shipped.best_all(h100.id)  # (one per workload: a workload shipped timed alone and behind counts once)
    workloads = {json.loads(line)["workload_key"] for line in (SHIPPED_DIR / "h100.jsonl").read_text().splitlines()}
    assert len(own) == len(workloads) > 0 and SHIPPED_FILES["h100.jsonl"]["records"] >= len(workloads)
    for rec in own:
        wl = recorded_workload(rec.workload, rec.workload_key)
        d = Dispatcher(h100, tmp_path / "none.db").choose(wl, h100)
        behind = rec.extra.get("behind")  # (the W4A8 records were timed alone)
        timed = f" (timed behind {behind['op']})" if behind else ""
        assert d.source == f"exact{timed} from shipped records", d
        assert d.schedule == rec.schedule
    wl = workload("gemm_w4a16", M=16, N=6144, K=4096, G=128, dtype="bf16")
    theirs = shipped.best(wl.key, h100.id)
    mine = shipped.best(workload("gemm_w4a16", M=16, N=6144, K=4096, G=128, dtype="fp16").key, h200.id)
    assert theirs is not None and mine is not None and theirs.schedule != mine.schedule
    d = Dispatcher(h200, tmp_path / "none.db").choose(wl, h200)
    assert d.source == "exact (timed behind rmsnorm) from shipped records, tuned on cuda:sm_90/h100", d
    assert d.schedule == theirs.schedule
    d = Dispatcher(h200, tmp_path / "none.db").choose(wl.with_dims(M=12), h200)  # no exact record: its own bucket
    assert d.source.startswith("bucket M=16, tuned in fp16") and d.schedule == mine.schedule, d


def test_the_h100_decoder_serves_a_short_context_its_own_attention_record(tmp_path):
    """Llama-3-8B's 64-row decode step at a 288-token context dispatches its paged attention at its
    context bucket (L = 512) and is served the H100's record of that bucket, exact, with fewer splits
    than the record of contexts up to 8192 that the step at the whole window is served."""
    from flashgen.runtime.decoder.bench import CONFIGS
    from flashgen.runtime.decoder.step_workloads import decode_step
    from flashgen.runtime.serving.dispatch import Dispatcher
    h100 = get_target("h100")
    dispatcher = Dispatcher(h100, tmp_path / "none.db")

    def served(context: int | None):
        wl = next(w for w, _ in decode_step(CONFIGS["llama3-8b"], "w4a16", 64, context=context)
                  if w.op.name == "paged_decode_attention")
        return wl.dim["L"], dispatcher.choose(wl, h100)

    (short_l, short), (long_l, whole) = served(288), served(None)
    assert (short_l, long_l) == (512, 8192)
    assert short.source == whole.source == "exact (timed behind rope_cache) from shipped records"
    assert short.schedule["splits"] < whole.schedule["splits"], (short.schedule, whole.schedule)


@pytest.mark.parametrize("mode, rows", [("w4a16", r) for r in (2, 4, 16, 32, 64, 128, 256)]
                         + [("w4a8", r) for r in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
                         + [("w8a8", r) for r in (4, 8, 16, 64, 256)])
def test_the_h100_decoder_serves_every_gemm_of_its_step_a_record_of_its_row_count(tmp_path, mode, rows):
    """Each GEMM of Llama-3-8B's decode step at these row counts is served an H100 record of its own
    workload, not one of a neighbouring row count (docs/findings.md lists the lines still without one): a 16-row tile served to 64, 128 or 256 rows, or the
    analytic default, took up to 2.2x the time of the line's own best on that GPU
    (benchmarks/results/model_quant_load.md#rows64_records, #rows256_new)."""
    from flashgen.runtime.decoder.bench import CONFIGS
    from flashgen.runtime.decoder.step_workloads import decode_step
    from flashgen.runtime.serving.dispatch import Dispatcher
    h100 = get_target("h100")
    dispatcher = Dispatcher(h100, tmp_path / "none.db")
    gemms = {w.key: w for w, _ in decode_step(CONFIGS["llama3-8b"], mode, rows) if w.op.kclass == "contraction"
             and w.op.name != "gemm"}.values()  # every layer alike; the bf16 lm_head runs torch's GEMM
    assert len(gemms) == 4, gemms
    for wl in gemms:
        choice = dispatcher.choose(wl, h100)
        assert choice.source.startswith("exact") and choice.source.endswith("from shipped records"), (wl, choice.source)


def test_the_h100_record_log_alone_rebuilds_its_shipped_file(tmp_path):
    """`h100_rows_records.jsonl` holds every record the H100 file ships: the maintainers' rebuild from it
    writes the same bytes (a record kept only in the shipped file would be lost by the next rebuild)."""
    folder = _copy(tmp_path)
    log = Database(":memory:")
    log.import_jsonl(str(ROOT / "benchmarks" / "results" / "h100_rows_records.jsonl"))
    shipped_mod.write_shipped(log.records(), "h100", folder)
    assert (folder / "h100.jsonl").read_bytes() == (SHIPPED_DIR / "h100.jsonl").read_bytes()


def test_a_rebuild_that_would_drop_a_shipped_workload_is_refused(tmp_path):
    folder = _copy(tmp_path)
    shipped = [Record.from_json(json.loads(line)) for line in (folder / "h100.jsonl").read_text().splitlines()]
    kept = shipped[1:]
    before = (folder / "h100.jsonl").read_bytes()
    with pytest.raises(FlashgenError, match="h100.jsonl: the records given hold nothing for 1 workload.*"
                       + re.escape(shipped[0].workload_key)):
        shipped_mod.write_shipped(kept, "h100", folder)
    assert (folder / "h100.jsonl").read_bytes() == before  # nothing written
    shipped_mod.write_shipped(kept, "h100", folder, drop=True)
    written = (folder / "h100.jsonl").read_text().splitlines()
    assert len(written) == len(kept) == len(shipped) - 1
    assert json.loads((folder / "MANIFEST.json").read_text())["files"]["h100.jsonl"]["records"] == len(kept)
