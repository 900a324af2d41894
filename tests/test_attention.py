"""Paged decode attention: interpreter numerics against a float64 reference, AOT builds, bad shapes."""
from __future__ import annotations

import pytest
import torch

import flashgen
from flashgen.errors import FlashgenError
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target

DEFAULT = {"pages": 2, "num_warps": 4, "num_stages": 2, "splits": 1}


def decode(**kw):
    base = dict(B=3, Hq=8, Hkv=2, D=64, BS=16, NB=40, MAXB=8, L=100, dtype="fp16")
    return flashgen.workload("paged_decode_attention", **{**base, **kw})


@pytest.mark.parametrize("hq, hkv", [(8, 8), (8, 2), (8, 1)])     # GQA groups of 1, 4 and 8
@pytest.mark.parametrize("d", [64, 128])
def test_gqa_and_head_dims(interpreter, hq, hkv, d):
    wl = decode(Hq=hq, Hkv=hkv, D=d)
    for c in interpreter.check(wl, DEFAULT, "h200", seed=hq + d):
        assert c.ok, c


@pytest.mark.parametrize("mod, params", [("window", {"window": 37.0}), ("softcap", {"softcap": 1.5}),
                                         ("alibi", None), ("none", None)])
def test_mods_are_expressions(interpreter, mod, params):
    """Each variant is an IR expression in the op; params chosen so the mod changes the result."""
    wl = decode(mod=mod)
    for c in interpreter.check(wl, DEFAULT, "h200", seed=2, params=params):
        assert c.ok, (mod, c)


def test_window_changes_the_result():
    wl = decode(mod="window")
    ins = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(0))
    a = wl.op.reference(ins, {**wl.op.params, "window": 37.0}, wl.dim, wl.attr)["out"]
    b = wl.op.reference(ins, {**wl.op.params, "window": 1e9}, wl.dim, wl.attr)["out"]
    assert (a - b).norm() > 0.1 * b.norm()


@pytest.mark.parametrize("schedule", [{"pages": 1, "num_warps": 2, "num_stages": 1, "splits": 1},
                                      {"pages": 4, "num_warps": 8, "num_stages": 3, "splits": 4},
                                      {"pages": 1, "num_warps": 4, "num_stages": 2, "splits": 32}])
@pytest.mark.parametrize("bs, length", [(16, 1), (16, 33), (32, 100)])
def test_ragged_contexts_and_tiles(interpreter, schedule, bs, length):
    """Context lengths drawn in [1, L] (one equal to L), not multiples of the block; one context of 1."""
    wl = decode(BS=bs, L=length, MAXB=-(-length // bs) + 1, NB=4 * (-(-length // bs) + 1))
    for c in interpreter.check(wl, schedule, "h200", seed=bs + length):
        assert c.ok, c


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "gfx90a", "gfx942"])
def test_aot_builds(target):
    wl = decode(dtype="bf16", D=128, Hq=32, Hkv=8, BS=16, NB=4096, MAXB=256, L=4096, mod="alibi")
    k = flashgen.compile(wl, target)
    assert k.binary[:4] == b"\x7fELF"
    text = k.asm["ptx"] if target.startswith("sm_") else k.asm["amdgcn"]
    assert ("mma" in text) or ("v_mfma" in text)


def test_bad_shapes_are_clear():
    with pytest.raises(FlashgenError, match="multiple of Hkv"):
        decode(Hq=6, Hkv=4)
    with pytest.raises(FlashgenError, match="cannot hold"):
        decode(MAXB=2, L=100)
    for d in (8, 12, 100, 264, 1 << 20):
        with pytest.raises(FlashgenError, match=f"head dim D={d} must be a multiple of 8 from 16 to 256"):
            decode(D=d)
        with pytest.raises(FlashgenError, match=f"head dim D={d} must be a multiple of 8"):
            prefill(D=d)
        with pytest.raises(FlashgenError, match=f"head dim D={d} must be a multiple of 8"):
            chunked(D=d)


def test_one_kernel_serves_any_batch_and_cache_size():
    """B, NB and MAXB are run-time dims: the schedule space and kernel do not depend on them."""
    a, b = decode(B=3, NB=40), decode(B=64, NB=4096, MAXB=64, L=1000)
    from flashgen.targets.triton.codegen import generate
    assert generate(a, DEFAULT).source == generate(b, DEFAULT).source
    assert ScheduleSpace(a, get_target("h200")).default() == {**DEFAULT, "early_kv": 0}


def test_prior_ranks_attention_schedules():
    from flashgen.schedules.cost_model import AnalyticPrior
    wl = decode(B=1, L=4096, NB=300, MAXB=256, Hq=32, Hkv=8, D=128)
    space = ScheduleSpace(wl, get_target("h200"))
    scheds = list(space)
    scores = AnalyticPrior().score(wl, scheds, get_target("h200"))
    best = scheds[int(scores.argmax())]
    assert len(scheds) == 4 * 3 * 3 * 6 * 2  # early_kv 0 and 1 on the H200
    assert best["splits"] >= 8  # one sequence, 8 KV heads: only a split context fills 132 SMs
    assert space.default()["splits"] >= 4


PREFILL = {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2}


def prefill(**kw):
    base = dict(T=100, B=4, Hq=8, Hkv=2, D=64, dtype="fp16")
    return flashgen.workload("flash_prefill_attention", **{**base, **kw})


@pytest.mark.parametrize("mod, params", [("none", None), ("window", {"window": 20.0}), ("softcap", {"softcap": 1.5}),
                                         ("alibi", None)])
@pytest.mark.parametrize("hq, hkv, d, t, b", [(4, 4, 32, 70, 1), (8, 2, 64, 100, 4), (8, 1, 128, 77, 6)])
def test_prefill_numerics(interpreter, mod, params, hq, hkv, d, t, b):
    """Packed ragged sequences (lengths from random cuts of T, ones included when B is large), causal."""
    wl = prefill(T=t, B=b, Hq=hq, Hkv=hkv, D=d, mod=mod)
    for c in interpreter.check(wl, PREFILL, "h200", seed=t + b, params=params):
        assert c.ok, (mod, c)


def test_prefill_tiles_other_than_default(interpreter):
    wl = prefill(T=150, B=3)
    for s in ({"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 1},
              {"block_m": 32, "block_n": 128, "num_warps": 4, "num_stages": 3}):
        assert ScheduleSpace(wl, get_target("h200")).is_valid(s)
        for c in interpreter.check(wl, s, "h200", seed=1):
            assert c.ok, (s, c)


def test_prefill_tiles_of_many_sequences(interpreter):
    """Query tiles are numbered sequence after sequence and each program finds its own: 70 sequences
    (more than one chunk of lengths read at once), most of them 1-3 tokens, a few longer than a tile;
    the grid's spare programs (one per sequence) do nothing."""
    from flashgen.targets.triton.codegen import generate, grid
    wl = prefill(T=200, B=70, Hq=4, Hkv=2, D=32)
    s = {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1}
    assert grid(generate(wl, s), wl) == (-(-200 // 32) + 70, 4, 1)
    for c in interpreter.check(wl, s, "h200", seed=[2, 3]):
        assert c.ok, c


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "gfx90a", "gfx942"])
def test_prefill_aot(target):
    wl = prefill(T=65536, B=8, Hq=32, Hkv=8, D=128, dtype="bf16")
    space = ScheduleSpace(wl, get_target(target))
    k = flashgen.compile(wl, target)
    assert space.is_valid(k.schedule) and k.binary[:4] == b"\x7fELF"


def test_fp8_kv_cache(interpreter):
    """e4m3 cache with per-tensor scales, fp16 queries (bf16 dots are wrong in the interpreter; reading
    e4m3 is exact there, only writing it is not)."""
    wl = decode(kv="fp8e4m3", dtype="fp16", mod="softcap")
    assert wl.tensor_dtype("k_cache") == "fp8e4m3" and wl.tensor_dtype("q") == "fp16"
    for c in interpreter.check(wl, DEFAULT, "h200", seed=5, params={"k_scale": 0.5, "v_scale": 2.0, "softcap": 3.0}):
        assert c.ok, c
    k = flashgen.compile(wl, "sm_90")
    assert "cvt" in k.asm["ptx"] and k.binary[:4] == b"\x7fELF"
    with pytest.raises(FlashgenError, match="does not support fp8e4m3"):
        flashgen.compile(wl, "sm_80")


def chunked(**kw):
    base = dict(T=90, B=3, Hq=8, Hkv=2, D=64, BS=16, NB=30, MAXB=5, dtype="fp16")
    return flashgen.workload("chunked_prefill_attention", **{**base, **kw})


@pytest.mark.parametrize("mod, params", [("none", None), ("window", {"window": 30.0}), ("alibi", None)])
def test_chunked_prefill_after_cached_prefix(interpreter, mod, params):
    """New tokens see their sequence's cached prefix (0..80 tokens, one sequence without) and each other
    causally; the prefix is read through the block table."""
    wl = chunked(mod=mod)
    for c in interpreter.check(wl, PREFILL, "h200", seed=8, params=params):
        assert c.ok, (mod, c)
    assert flashgen.compile(wl, "gfx942").binary[:4] == b"\x7fELF"


def test_chunked_prefill_without_prefix_is_prefill():
    import torch
    wl = chunked()
    ins = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(0))
    ins["prefix_lens"].zero_()
    plain = flashgen.workload("flash_prefill_attention", T=90, B=3, Hq=8, Hkv=2, D=64, dtype="fp16")
    a = wl.op.reference(ins, wl.op.params, wl.dim, wl.attr)["out"]
    b = plain.op.reference(ins, plain.op.params, plain.dim, plain.attr)["out"]
    assert torch.allclose(a, b)


@pytest.mark.parametrize("mod, params", [("window", {"window": 9.0}), ("alibi", None)])
def test_reference_in_query_chunks_matches_whole(monkeypatch, mod, params):
    """Long sequences are checked against a reference computed in query chunks: chunking changes nothing."""
    from flashgen.oplib import attention

    wl = flashgen.workload("flash_prefill_attention", T=70, B=2, Hq=4, Hkv=2, D=16, dtype="fp16", mod=mod)
    ins = wl.op.make_inputs(wl.dim, wl.attr, torch.Generator().manual_seed(5))
    p = {**wl.op.params, **(params or {})}
    whole = wl.op.reference(ins, p, wl.dim, wl.attr)["out"]
    monkeypatch.setattr(attention, "REFERENCE_SCORES", 4 * 70 * 3)  # 3 query rows at a time
    chunked = wl.op.reference(ins, p, wl.dim, wl.attr)["out"]
    assert torch.allclose(whole, chunked, rtol=1e-12, atol=1e-12)
    assert whole.abs().max() > 0


def test_tables_wider_than_the_cache(interpreter):
    """A runtime pads every block table to one width, which may exceed the cache's block count."""
    wl = decode(NB=6, MAXB=8, L=100)
    for c in interpreter.check(wl, DEFAULT, "h200", seed=4):
        assert c.ok, c


def test_split_scratch_carries_no_stale_partials(interpreter):
    """One launcher, calls with different context lengths in turn: a long call leaves partial results
    in splits that a later, shorter call leaves empty, and the merge must not read them."""
    wl = decode(BS=16, L=300, MAXB=20, NB=80)
    checks = interpreter.check(wl, {"pages": 1, "num_warps": 4, "num_stages": 2, "splits": 16}, "h200",
                               seed=[5, 6, 7, 8])
    assert len(checks) == 4 and all(c.ok for c in checks), checks


def test_split_merge_in_chunks(interpreter):
    """A merge too large for one register tile (8 query heads per KV head, D=128, 32 splits, 2 warps)
    reads the splits' partials a chunk at a time; ragged contexts leave some chunks wholly empty."""
    from flashgen.targets.triton.codegen import generate
    wl = decode(Hq=8, Hkv=1, D=128, BS=16, L=300, MAXB=20, NB=80)
    schedule = {"pages": 1, "num_warps": 2, "num_stages": 2, "splits": 32}
    assert generate(wl, schedule).source.count("merged += ") == 7
    for c in interpreter.check(wl, schedule, "h200", seed=[11, 12]):
        assert c.ok, c


@pytest.mark.parametrize("wl", [prefill(T=150, B=4, Hq=8, Hkv=2, D=64), prefill(T=77, B=6, Hq=8, Hkv=1, D=128, mod="window"),
                                chunked()], ids=["causal", "window", "chunked"])
def test_prefill_tma_tiles(interpreter, wl):
    """Key and value tiles copied by TMA descriptors: rows past a sequence (the next one's, or zeros past
    T) are masked out of the logits, and their values zeroed; the cached prefix is still read through
    the block table."""
    s = {**PREFILL, "tma": 1}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s)
    params = {"window": 20.0} if wl.attr["mod"] == "window" else None
    for c in interpreter.check(wl, s, "h200", seed=[3, 4], params=params):
        assert c.ok, c


def test_prefill_tma_rules_and_build():
    """TMA tiles for prefill are offered on sm_90 only; a record from before the knob reads as tma=0;
    the sm_90 binary copies its key and value tiles with UTMALDG."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import opcodes, summary
    wl = prefill(T=65536, B=8, Hq=32, Hkv=8, D=128, dtype="bf16")
    assert ScheduleSpace(wl, get_target("h200")).knobs()["tma"] == (0, 1)
    assert ScheduleSpace(wl, get_target("a100")).knobs()["tma"] == (0,)
    assert ScheduleSpace(wl, get_target("mi300x")).knobs()["tma"] == (0,)
    old = {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}
    assert ScheduleSpace(wl, get_target("h200")).complete(old) == {**old, "tma": 0, "backend": 0, "consumers": 1, "pingpong": 0,
                                                                  "persistent": 0}
    assert "tma" not in ScheduleSpace(decode(), get_target("h200")).knobs()
    sass = summary(opcodes(flashgen.compile(wl, "sm_90", schedule={**old, "tma": 1}).binary))
    assert sass["tma"] > 0 and sass["wgmma"] > 0, sass
    assert summary(opcodes(flashgen.compile(wl, "sm_90", schedule=old).binary))["tma"] == 0


EARLY_KV = [({"pages": 1, "num_warps": 2, "num_stages": 1, "splits": 1, "early_kv": 1}, 16, 1, "none"),
            ({"pages": 2, "num_warps": 4, "num_stages": 2, "splits": 4, "early_kv": 1}, 16, 100, "window"),
            ({"pages": 1, "num_warps": 4, "num_stages": 2, "splits": 32, "early_kv": 1}, 16, 33, "softcap"),
            ({"pages": 4, "num_warps": 4, "num_stages": 2, "splits": 2, "early_kv": 1}, 32, 100, "alibi")]


@pytest.mark.parametrize("schedule, bs, length, mod", EARLY_KV, ids=lambda v: str(v) if not isinstance(v, dict) else
                         f"p{v['pages']}-s{v['splits']}")
def test_early_kv_numerics(interpreter, schedule, bs, length, mod):
    """early_kv peels the first loop step (its tiles load before the wait) and adds the newest key, at
    the query's own position, as a column of its own in the split that holds it: contexts of 1 (the
    newest key alone), ragged contexts not multiples of the block, splits left empty, and each mod."""
    wl = decode(BS=bs, L=length, MAXB=-(-length // bs) + 1, NB=4 * (-(-length // bs) + 1), mod=mod)
    assert ScheduleSpace(wl, get_target("h200")).is_valid(schedule)
    params = {"window": 37.0} if mod == "window" else {"softcap": 1.5} if mod == "softcap" else None
    for c in interpreter.check(wl, schedule, "h200", seed=[bs + length, 3], params=params):
        assert c.ok, c


def test_scales_belong_to_an_fp8_cache(interpreter):
    """A cache in the query's dtype holds the keys and values themselves: k_scale and v_scale do not
    apply to it, in the kernel and in the reference alike."""
    wl = decode(dtype="fp16")
    for c in interpreter.check(wl, DEFAULT, "h200", seed=6, params={"k_scale": 0.5, "v_scale": 2.0}):
        assert c.ok, c


def test_early_kv_fp8(interpreter):
    """The newest key and value of an e4m3 cache are scaled like every other."""
    wl = decode(kv="fp8e4m3", dtype="fp16", L=70, MAXB=6, NB=24)
    s = {"pages": 2, "num_warps": 4, "num_stages": 2, "splits": 2, "early_kv": 1}
    for c in interpreter.check(wl, s, "h200", seed=9, params={"k_scale": 0.5, "v_scale": 2.0}):
        assert c.ok, c


def test_early_kv_rules_and_order():
    """The knob exists where PDL does. In the source, the query and the newest key are read only after
    the wait, the first step's cache tiles before it; in the sm_90 PTX, global loads precede the wait."""
    from flashgen.targets.triton.codegen import generate
    wl = decode(dtype="bf16", D=128, Hq=32, Hkv=8, BS=16, NB=160, MAXB=512, L=2560)
    assert ScheduleSpace(wl, get_target("h200")).knobs()["early_kv"] == (0, 1)
    for t in ("a100", "mi300x"):
        assert ScheduleSpace(wl, get_target(t)).knobs()["early_kv"] == (0,)
    assert ScheduleSpace(wl, get_target("h200")).complete({**DEFAULT, "splits": 16})["early_kv"] == 0
    s = {"pages": 8, "num_warps": 4, "num_stages": 2, "splits": 16, "early_kv": 1}
    src = generate(wl, s).source
    before, after = src[:src.index("gdc_wait")], src[src.index("gdc_wait"):]
    assert "tl.load(k_cache_ptr" in before and "tl.load(v_cache_ptr" in before and "block_tables_ptr" in before
    assert "tl.load(q_ptr" not in before and "tl.load(q_ptr" in after and "kn = tl.load(k_cache_ptr" in after
    for early in (1, 0):
        ptx = flashgen.compile(wl, "sm_90", schedule={**s, "early_kv": early}).asm["ptx"].splitlines()
        wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
        assert any("ld.global" in line for line in ptx[:wait]) == bool(early)


def test_pin_records_makes_dispatch_take_a_chosen_schedule(tmp_path, monkeypatch):
    """benchmarks/studies/pin_records.py: of one workload's records only the chosen schedule's (or knob value's)
    stay, so dispatch, which takes the workload's best, runs it (a schedule given without the knobs that
    records may predate matches as their neutral value); other workloads keep every record, and
    a pin that leaves the workload no record is refused (dispatch would fall back to another one)."""
    import json
    import sys
    from pathlib import Path

    from flashgen.compiler import choose_schedule
    from flashgen.db import Database, Record
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    import pin_records

    wl = decode(dtype="bf16", D=128, Hq=32, Hkv=8, BS=16, NB=160, MAXB=512, L=2560, B=1)
    other = decode(dtype="bf16", D=128, Hq=32, Hkv=8, BS=16, NB=160, MAXB=512, L=2560, B=8)
    fast, slow = {**DEFAULT, "splits": 16}, {**DEFAULT, "splits": 32, "early_kv": 1}
    src = tmp_path / "all.jsonl"
    with Database(tmp_path / "all.db") as db:
        for w, s, lat in ((wl, fast, 8.0), (wl, slow, 9.0), (other, fast, 20.0), (other, slow, 21.0)):
            db.add(Record(workload_key=w.key, workload=w.to_json(), target_key=get_target("h200").id, schedule=s,
                          status="ok", latency_us=lat, device="NVIDIA H200"))
        db.export_jsonl(src)
    for i, pick in enumerate((["--schedule", json.dumps(slow)], ["--knob", "early_kv=1"])):
        out = tmp_path / "pinned.jsonl"
        monkeypatch.setattr(sys, "argv", ["pin_records.py", str(out), str(src), "--op", wl.op_name, "--dim", "B=1",
                                          "--dim", "L=2560", *pick])
        pin_records.main()
        assert len(out.read_text().splitlines()) == 3
        with Database(tmp_path / f"pinned{i}.db") as db:
            db.import_jsonl(out)
            assert choose_schedule(wl, get_target("h200"), db, None)[0] == slow
            assert choose_schedule(other, get_target("h200"), db, None)[0] == {**fast, "early_kv": 0}  # completed
    assert "early_kv" not in fast  # given without the knob, the schedule still matches its records
    monkeypatch.setattr(sys, "argv", ["pin_records.py", str(tmp_path / "fast.jsonl"), str(src), "--op", wl.op_name,
                                      "--dim", "B=1", "--schedule", json.dumps(fast)])
    pin_records.main()
    assert len((tmp_path / "fast.jsonl").read_text().splitlines()) == 3
    monkeypatch.setattr(sys, "argv", ["pin_records.py", str(tmp_path / "none.jsonl"), str(src), "--op", wl.op_name,
                                      "--dim", "B=1", "--knob", "pages=4"])
    with pytest.raises(FlashgenError, match="no record"):
        pin_records.main()


def test_attention_benchmark_reranks_the_fastest_recorded_schedules(tmp_path):
    """benchmarks/attention.py re-times the database's fastest distinct schedules on its own inputs: a
    record older than `early_kv` reads as early_kv=0 (one schedule with its newer twin), failed and
    invalid records are left out, fastest first, at most k."""
    import sys
    from pathlib import Path

    from flashgen.db import Database, Record
    from flashgen.schedules.space import ScheduleSpace
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from attention import fastest_recorded

    wl = decode(dtype="bf16", D=128, Hq=32, Hkv=8, BS=16, NB=160, MAXB=512, L=2560, B=1)
    target = get_target("h200")
    new = {**DEFAULT, "early_kv": 0}
    rows = [({**DEFAULT, "splits": 16}, 7.0, "ok"), ({**new, "splits": 16}, 7.5, "ok"), ({**new, "splits": 8}, 9.0, "ok"),
            ({**new, "splits": 4}, None, "wrong_result"), ({**new, "splits": 3}, 5.0, "ok"), ({**new, "splits": 32}, 8.0, "ok")]
    with Database(tmp_path / "db") as db:
        for s, lat, status in rows:
            db.add(Record(workload_key=wl.key, workload=wl.to_json(), target_key=target.id, schedule=s, status=status,
                          latency_us=lat, device="NVIDIA H200"))
        space = ScheduleSpace(wl, target)
        got = fastest_recorded(db, wl, target, space, 3)
        assert got == [{**new, "splits": 16}, {**new, "splits": 32}, {**new, "splits": 8}]
        assert fastest_recorded(db, wl, target, space, 1) == got[:1]


# ---- head dims that are not powers of two: tiles padded to D_PAD, the pad columns masked ----------
HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256)  # Llama, Qwen, Phi and Gemma heads
PADDED = [(80, "none", "same", {**DEFAULT, "splits": 2}), (96, "window", "same", {**DEFAULT, "splits": 1, "early_kv": 1}),
          (112, "softcap", "fp8e4m3", {**DEFAULT, "splits": 4, "early_kv": 1}), (192, "alibi", "same", {**DEFAULT, "splits": 2}),
          (256, "softcap", "fp8e4m3", {**DEFAULT, "splits": 1})]
MOD_PARAMS = {"window": {"window": 9.0}, "softcap": {"softcap": 1.5}}


@pytest.mark.parametrize("d, mod, kv, schedule", PADDED, ids=lambda v: str(v) if not isinstance(v, dict) else
                         f"s{v['splits']}-e{v.get('early_kv', 0)}")
def test_padded_head_dims_decode(interpreter, d, mod, kv, schedule):
    """Each padded head dim with GQA groups of 2, ragged contexts, a mod, split-KV merges, early_kv and
    the e4m3 cache (whose masked lanes are undefined until zeroed)."""
    wl = decode(B=2, Hq=4, Hkv=2, D=d, BS=16, L=40, MAXB=4, NB=10, mod=mod, kv=kv)
    assert ScheduleSpace(wl, get_target("h200")).is_valid(schedule)
    params = {**MOD_PARAMS.get(mod, {}), **({"k_scale": 0.5, "v_scale": 2.0} if kv == "fp8e4m3" else {})}
    for c in interpreter.check(wl, schedule, "h200", seed=d, params=params or None):
        assert c.ok, c


@pytest.mark.parametrize("d, mod, tma", [(80, "none", 1), (96, "alibi", 0), (112, "window", 0), (192, "softcap", 1),
                                         (256, "none", 0)])
def test_padded_head_dims_prefill(interpreter, d, mod, tma):
    """Packed ragged sequences longer than a key tile (so the unmasked full tiles run), a GQA group of 2,
    with TMA tiles, whose boxes of D_PAD columns the copy fills with zeros past D."""
    wl = prefill(T=45, B=2, Hq=4, Hkv=2, D=d, mod=mod)
    s = {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 1, "tma": tma}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s)
    for c in interpreter.check(wl, s, "h200", seed=d, params=MOD_PARAMS.get(mod)):
        assert c.ok, c


@pytest.mark.parametrize("d, mod, tma", [(80, "alibi", 0), (96, "none", 1), (112, "softcap", 0), (192, "window", 0),
                                         (256, "none", 1)])
def test_padded_head_dims_chunked_prefill(interpreter, d, mod, tma):
    """New tokens after cached prefixes read through the block table, with padded heads."""
    wl = chunked(T=40, B=2, Hq=4, Hkv=2, D=d, BS=16, NB=8, MAXB=3, mod=mod)
    s = {**PREFILL, "num_stages": 1, "tma": tma}
    for c in interpreter.check(wl, s, "h200", seed=d, params=MOD_PARAMS.get(mod)):
        assert c.ok, c


def test_power_of_two_heads_are_not_padded():
    """A power-of-two head dim generates no D_PAD and no column mask; any other gets both."""
    from flashgen.targets.triton.codegen import generate
    for d in HEAD_DIMS:
        for wl, s in ((decode(D=d), {**DEFAULT, "splits": 4, "early_kv": 1}), (chunked(D=d), {**PREFILL, "tma": 1})):
            src = generate(wl, s).source
            padded = d & (d - 1) != 0
            assert ("D_PAD: tl.constexpr" in src) == padded and ("dmask" in src) == padded, d
            assert f"tl.arange(0, {'D_PAD' if padded else 'D'})" in src


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "gfx90a", "gfx942"])
def test_every_head_dim_has_a_valid_default(target):
    """The defaults fit the padded tiles in the target's shared memory and registers: 8 warps for
    256-column accumulators on 32-lane warps, 32-key tiles in AMD's 64 KB."""
    for d in HEAD_DIMS:
        for wl in (decode(D=d, Hq=32, Hkv=8, L=4096, MAXB=256, NB=4096), prefill(D=d, T=65536, B=8, Hq=32, Hkv=8),
                   chunked(D=d, T=4096, B=8, Hq=32, Hkv=8, NB=4096, MAXB=256)):
            space = ScheduleSpace(wl, get_target(target))
            assert space.is_valid(space.default()), (d, space.default(), space.why_invalid(space.default()))


# each head dim built for one target in turn, the two widest (where shared memory binds) for both; every
# dim's defaults are valid on every target (test_every_head_dim_has_a_valid_default)
AOT_HEAD_DIMS = [(d, t) for i, d in enumerate(HEAD_DIMS) for t in ("h200", "mi300x")
                 if d >= 192 or i % 2 == ("h200", "mi300x").index(t)]


@pytest.mark.parametrize("d, target", AOT_HEAD_DIMS)
def test_head_dims_aot(target, d):
    """The default schedule of each op builds for each head dim, within the target's shared memory."""
    smem = int(get_target(target).get("smem_per_block"))
    for wl in (decode(dtype="bf16", D=d, Hq=32, Hkv=8, BS=16, NB=4096, MAXB=256, L=4096),
               prefill(T=65536, B=8, Hq=32, Hkv=8, D=d, dtype="bf16"),
               chunked(T=4096, B=8, Hq=32, Hkv=8, D=d, NB=4096, MAXB=256, dtype="bf16")):
        k = flashgen.compile(wl, target)
        assert k.binary[:4] == b"\x7fELF" and 0 < k.metadata["shared_bytes"] <= smem, (wl, k.metadata["shared_bytes"])
        text = k.asm["ptx"] if target == "h200" else k.asm["amdgcn"]
        assert ("mma" in text) or ("v_mfma" in text)


@pytest.mark.parametrize("d", [80, 192])
def test_padded_head_tma_build(d):
    """TMA boxes of D_PAD columns over [T, Hkv, D] tensors (rows of D * 2 bytes, 16-byte aligned) build
    on sm_90 and copy with UTMALDG; the copy fills the columns past D with zeros."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import opcodes, summary
    wl = prefill(T=65536, B=8, Hq=32, Hkv=8, D=d, dtype="bf16")
    s = {"block_m": 64, "block_n": 64, "num_warps": 8 if d > 128 else 4, "num_stages": 2, "tma": 1}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s)
    sass = summary(opcodes(flashgen.compile(wl, "sm_90", schedule=s).binary))
    assert sass["tma"] > 0 and sass["wgmma"] > 0, sass
