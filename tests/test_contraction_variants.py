"""Contraction schedules in variant form: bounded raw spaces, records of the flat form read as their
variant (the rules' verdict and the schedule key unchanged), flat knob pins, dispatch of the shipped records."""
from __future__ import annotations

import glob
import json
import random
from collections import Counter
from pathlib import Path

import pytest

import flashgen
from flashgen.db.record import schedule_key
from flashgen.ir.variants import VARIANTS
from flashgen.schedules.search import Evolutionary
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target, load_targets
from flashgen.workload import Workload

ROOT = Path(__file__).resolve().parents[1]

# Raw points (the product of the knobs' value counts, summed over the variants) at most, per workload:
# a new knob or value that grows a space past its cap is a decision, made here. (Flat, before variants:
# bf16 M=4096 on the H200 1,612,800; W4A16 51,609,600.)
CAPS = {
    ("h200", "bf16", 1): 14105, ("h200", "w4a16", 1): 21265, ("h200", "bf16", 16): 61880,
    ("h200", "w4a16", 16): 123640, ("h200", "bf16", 256): 72800, ("h200", "w4a16", 256): 66400,
    ("h200", "bf16", 4096): 72800, ("h200", "w4a16", 4096): 333600,
    ("a100", "bf16", 1): 9900, ("a100", "w4a16", 1): 19980, ("a100", "bf16", 16): 54000,
    ("a100", "w4a16", 16): 114480, ("a100", "bf16", 256): 36000, ("a100", "w4a16", 256): 64800,
    ("a100", "bf16", 4096): 36000, ("a100", "w4a16", 4096): 208800,
    ("mi300x", "bf16", 1): 4320, ("mi300x", "w4a16", 1): 2880, ("mi300x", "bf16", 16): 21960,
    ("mi300x", "w4a16", 16): 15480, ("mi300x", "bf16", 256): 18000, ("mi300x", "w4a16", 256): 10800,
    ("mi300x", "bf16", 4096): 18000, ("mi300x", "w4a16", 4096): 82800,
}
# Contraction records each file holds whose schedules the rules accept (True) and refuse (False): the
# counts of the flat rules before variants (the H100's files were written in variant form; the 5 refused
# H100 ones are generic matrix tiles on `lanes` codes, which the rules refuse since they took 100x the lanes tiles).
VERDICTS = {
    ("h100.jsonl", True): 130, ("h100_rows_records.jsonl", False): 5, ("h100_rows_records.jsonl", True): 717,
    ("h200.jsonl", True): 117, ("h200_fused_records.jsonl", True): 69, ("h200_gemm_records.jsonl", False): 139,
    ("h200_gemm_records.jsonl", True): 2301, ("h200_gluon_int4_records.jsonl", False): 72,
    ("h200_gluon_int4_records.jsonl", True): 112, ("h200_gluon_records.jsonl", True): 136,
    ("h200_w4a8_records.jsonl", True): 168,
}


def _workload(kind: str, m: int) -> Workload:
    if kind == "bf16":
        return flashgen.workload("gemm", M=m, N=4096, K=4096, dtype="bf16")
    return flashgen.workload("gemm_w4a16", M=m, N=4096, K=4096, G=128, dtype="fp16", group="group", pack="k128")


@pytest.mark.parametrize("target, kind, m", sorted(CAPS))
def test_raw_space_is_capped(target, kind, m):
    space = ScheduleSpace(_workload(kind, m), get_target(target))
    assert 0 < space.raw_size() <= CAPS[(target, kind, m)]
    # a schedule holds its variant's knobs alone: no GEMV form reads a Gluon, TMA or dequant knob
    for form, knobs in space.forms().items():
        if VARIANTS[form].gemv:
            assert set(knobs) <= {"block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m", "split_k",
                                  "persistent"}, form
            assert ("group_m" in knobs) == (m > 1), form  # one row of tiles: nothing to group


def _contraction_records():
    files = sorted(glob.glob(str(ROOT / "benchmarks/results/*records*.jsonl")) + glob.glob(str(ROOT / "flashgen/db/shipped/*.jsonl")))
    targets = load_targets()
    for f in files:
        for line in Path(f).read_text().splitlines():
            r = json.loads(line)
            wl = Workload.from_json(r["workload"])
            if wl.op.kclass == "contraction":
                yield Path(f).name, ScheduleSpace(wl, targets[r["target_key"]]), r["schedule"]


def test_records_read_as_their_variant():
    """Every recorded schedule (flat, or already in variant form) reads as a valid variant-form schedule,
    or is refused as the flat rules refused it; the read is stable (its key does not change when read
    again or spelled out flat and read back), and a flat record missing a knob added since reads as the
    one holding its neutral value."""
    verdicts = Counter()
    for name, space, s in _contraction_records():
        mapped = space.complete(s)
        valid = space.is_valid(s)
        verdicts[(name, valid)] += 1
        if valid:
            assert set(mapped) == {"variant", *space.forms()[mapped["variant"]]}, (s, mapped)
            assert schedule_key(space.complete(mapped)) == schedule_key(mapped)
            assert space.complete(space.flat(mapped)) == mapped
            if "variant" not in s:  # a flat record: the knobs added since read as their neutral values
                spelled = {**space.rules.ADDED_KNOBS, **s}
                assert schedule_key(space.complete(spelled)) == schedule_key(mapped)
    assert dict(verdicts) == VERDICTS


def test_dispatch_serves_the_shipped_records_schedules(tmp_path):
    """For every workload of the shipped records, dispatch on the device they were tuned on serves its
    fastest record's schedule (its meaning: the same generator form, tiles and counts), now in variant
    form."""
    from flashgen.runtime.serving.dispatch import Dispatcher

    from flashgen.db import Database

    files = sorted(glob.glob(str(ROOT / "flashgen/db/shipped/*.jsonl")))
    with Database(tmp_path / "shipped.db") as db:  # the shipped files as a user's database: the same lookup
        for f in files:
            db.import_jsonl(f)
        best = db.best_all(None)
    assert {rec.target_key for rec in best} == {get_target(Path(f).stem).id for f in files}  # each file its device's
    dispatcher = Dispatcher(None, db=tmp_path / "shipped.db")
    served = 0
    for rec in best:
        wl = Workload.from_json(rec.workload)
        if wl.op.kclass != "contraction":
            continue
        target = get_target(rec.target_key)
        space = ScheduleSpace(wl, target)
        decision = dispatcher.choose(wl, target)
        assert decision.source.startswith("exact"), (wl, decision.source)
        assert "variant" in space.complete(decision.schedule)
        assert space.flat(decision.schedule) == space.flat(rec.schedule), wl
        served += 1
    assert served > 20


def test_a_tile_serves_other_row_counts_with_group_m_as_they_read_it(tmp_path):
    """group_m is read only where a form's smallest tile leaves more than one row of tiles: a tile tuned
    at 16 rows (no group_m) serves 32 rows as group_m = 1, and a 16-row tile tuned at 64 rows with
    group_m = 8 serves 16 rows without it; dispatch then serves a 32-row call from the 16-row record,
    a bucket of its own form, where it ran the analytic default before."""
    from flashgen.db import Database, Record
    from flashgen.runtime.serving.dispatch import Dispatcher

    h100 = get_target("h100")
    wl16 = flashgen.workload("gemm_w4a8", M=16, N=1000, K=1024, G=128, dtype="bf16", pack="lanes")
    tuned16 = {"variant": "tile_lanes", "block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4,
               "num_stages": 3, "split_k": 1, "persistent": 0}
    assert ScheduleSpace(wl16, h100).why_invalid(tuned16) is None
    space32 = ScheduleSpace(wl16.with_dims(M=32), h100)
    assert space32.why_invalid(tuned16) is None and space32.complete(tuned16) == {**tuned16, "group_m": 1}
    tuned64 = {**tuned16, "group_m": 8}
    assert ScheduleSpace(wl16.with_dims(M=64), h100).why_invalid(tuned64) is None
    assert ScheduleSpace(wl16, h100).complete(tuned64) == tuned16
    with Database(tmp_path / "db.sqlite") as db:
        db.add(Record(workload_key=wl16.key, workload=wl16.to_json(), target_key=h100.id, schedule=tuned16,
                      status="ok", latency_us=9.0, device="NVIDIA H100 80GB HBM3"))
    d = Dispatcher(h100, tmp_path / "db.sqlite").choose(wl16.with_dims(M=32), h100)
    assert d.source == "bucket M=16" and space32.complete(d.schedule) == {**tuned16, "group_m": 1}


def test_flat_pins_keep_the_variants_they_stand_for():
    """`--fix backend=1`, `--fix tma=1` (flat knob names) keep the variants holding them; `--fix
    variant=...` one variant; a count a variant never reads keeps it only at its default."""
    wl = flashgen.workload("gemm", M=4096, N=4096, K=4096, dtype="bf16")
    h200 = get_target("h200")
    assert set(ScheduleSpace(wl, h200, (("tma", 1),)).forms()) == {"tile_tma"}
    tma = ScheduleSpace(wl, h200, (("tma", 1),))
    assert tma.pinned_default() == tma.default() and tma.flat(tma.default())["tma"] == 1
    gluon = ScheduleSpace(wl, h200, (("backend", 1),))
    assert set(gluon.forms()) == {f for f in VARIANTS if f.startswith("gluon") and f not in ("gluon_int4", "gluon_lanes")}
    assert gluon.pinned_default() is None  # the default's TMA copies are Triton's, as before variants
    split = ScheduleSpace(wl, h200, (("split_k", 2),))
    assert "gluon" not in split.forms() and split.forms()["tile"]["split_k"] == (2,)
    one = ScheduleSpace(wl, h200, (("variant", "gluon_warp"), ("persistent", 1)))
    assert list(one.forms()) == ["gluon_warp"] and one.forms()["gluon_warp"]["persistent"] == (1,)
    pinned = one.pinned_default()
    assert pinned["variant"] == "gluon_warp" and pinned["persistent"] == 1 and one.flat(pinned)["producer_warps"] == 1
    with pytest.raises(flashgen.FlashgenError, match="not one of"):
        ScheduleSpace(wl, get_target("a100"), (("backend", 1),)).knobs()
    with pytest.raises(flashgen.FlashgenError, match="no such knob"):
        ScheduleSpace(wl, h200, (("block_r", 1),)).knobs()


def test_search_mutates_and_crosses_variants():
    """The evolutionary search's moves stay in the space: a mutation may change the variant (the knobs
    follow its form), a crossover takes one parent's form."""
    wl = flashgen.workload("gemm", M=4096, N=4096, K=4096, dtype="bf16")
    space = ScheduleSpace(wl, get_target("h200"))
    evo = Evolutionary(space, seed=0)
    rng = random.Random(1)
    parents = [s for s in (space.sample(rng) for _ in range(4000)) if space.is_valid(s)][:40]
    forms = set()
    for a, b in zip(parents, parents[1:]):
        child = evo.mutate(a)
        assert child is not None and space.is_valid(child)
        forms.add((a["variant"], child["variant"]))
        cross = evo.crossover(a, b)
        assert cross["variant"] in (a["variant"], b["variant"])
        assert set(cross) == set(space.form_knobs(cross))
    assert any(x != y for x, y in forms)
