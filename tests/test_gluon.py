"""The Gluon generator on a machine with no GPU: which schedules the space offers it, the source it
writes, and ahead-of-time builds for sm_90 whose PTX holds what the kernel is made of (its numerics
run on the device: tests/test_gpu.py `test_gluon_tiles_on_gpu`)."""
from __future__ import annotations

import random

import pytest

import flashgen
from flashgen.errors import FlashgenError
from flashgen.kernel_classes import current_schedule
from flashgen.schedules.contraction_space import gluon_invalid
from flashgen.schedules.space import ScheduleSpace
from flashgen.targets import get_target

SM90 = get_target("sm_90")


def generate(wl, s):
    """The source of `wl` for schedule `s`, flat or in variant form, as `flashgen.compile` reads it."""
    from flashgen.targets.triton.codegen import generate as _generate

    return _generate(wl, current_schedule(wl, s))


def _schedule(wl, **over):
    space = ScheduleSpace(wl, SM90)
    s = {**space.flat(space.default()), "split_k": 1, "persistent": 0, "tma": 0, "early_load": 0, "group_m": 8, "backend": 1,
         **over}
    assert space.is_valid(s), space.why_invalid(s)
    return s


@pytest.mark.parametrize("target", ["sm_80", "gfx942", "cpu"])
def test_offered_on_sm90_only(target):
    wl = flashgen.workload("gemm", M=256, N=4096, K=4096, dtype="bf16")
    assert ScheduleSpace(wl, SM90).values("backend") == (0, 1)
    if target != "cpu":
        assert ScheduleSpace(wl, get_target(target)).values("backend") == (0,)


def test_offered_for_plain_operands_and_symmetric_int4():
    """A weight prologue of symmetric int4 codes in whole 128-k blocks has a Gluon tile of its own;
    other prologues (zero points, groups of 80 k) only as the weight dequantized first."""
    w4 = flashgen.workload("gemm_w4a16", M=4096, N=4096, K=4096, G=128, dtype="bf16")
    space = ScheduleSpace(w4, SM90)
    assert space.values("backend") == (0, 1)
    for other_target in ("sm_80", "gfx942"):  # TMA, mbarriers and warpgroup MMA are Hopper's
        assert ScheduleSpace(w4, get_target(other_target)).values("backend") == (0,)
    base = {**space.flat(space.default()), "backend": 1, "ptx_unpack": 0, "operand_scale": 0, "persistent": 0, "tma": 0}
    assert "PTX" in space.why_invalid({**base, "producer_warps": 1, "dequant_first": 0, "dequant_chunks": 1})
    staged = {**base, "dequant_first": 1, "block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8,
              "num_stages": 3, "dequant_chunks": 1}
    assert space.why_invalid(staged) is None
    # beside the side stream's dequants a Gluon tile's time varied 2x between timings: one chunk only
    assert "one chunk" in space.why_invalid({**staged, "dequant_chunks": 2})
    assert space.why_invalid({**staged, "backend": 0, "producer_warps": 0, "dequant_chunks": 2}) is None
    for kw in ({"G": 128, "zp": "asym"}, {"G": 80}):
        other = flashgen.workload("gemm_w4a16", M=256, N=4096, K=4000 if kw["G"] == 80 else 4096, dtype="bf16", **kw)
        assert ScheduleSpace(other, SM90).values("backend") == (0,)
        assert "symmetric int4" in gluon_invalid(other, SM90, base)


@pytest.mark.parametrize("over, why", [
    ({"num_warps": 2, "block_m": 64}, "whole warpgroups"),
    ({"num_warps": 8, "block_m": 64}, "whole warpgroups"),
    ({"block_k": 128}, "128 bytes"),
    ({"split_k": 2}, "unsplit"),
    ({"persistent": 1, "producer_warps": 0}, "with a producer warp"),
    ({"tma": 1}, "own TMA copies"),
    ({"backend": 0, "producer_warps": 1}, "serve Gluon tiles"),
    ({"backend": 0, "tma_store": 1}, "serve Gluon tiles"),
    ({"backend": 0, "consumers": 2}, "serve Gluon tiles"),
    ({"consumers": 2, "producer_warps": 1, "persistent": 0}, "take turns at a persistent program's tiles"),
    ({"consumers": 2, "producer_warps": 1, "persistent": 1, "num_warps": 8, "block_m": 128}, "one warpgroup"),
])
def test_rules_name_what_is_wrong(over, why):
    wl = flashgen.workload("gemm", M=256, N=4096, K=4096, dtype="bf16")
    space = ScheduleSpace(wl, SM90)
    s = {**space.flat(space.default()), "block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3,
         "split_k": 1, "persistent": 0, "tma": 0, "backend": 1, **over}
    assert why in (space.why_invalid(s) or ""), space.why_invalid(s)


def test_int8_tiles_at_most_128_columns():
    wl = flashgen.workload("gemm_w8a8", M=256, N=4096, K=4096, dtype="bf16")
    space = ScheduleSpace(wl, SM90)
    s = {**space.flat(space.default()), "block_m": 128, "block_n": 256, "block_k": 128, "num_warps": 8, "num_stages": 3,
         "split_k": 1, "persistent": 0, "tma": 0, "backend": 1}
    assert "at most 128 columns" in space.why_invalid(s)
    assert space.why_invalid({**s, "block_n": 128}) is None


def test_persistent_programs_walk_the_tiles():
    """A persistent Gluon kernel launches at most `persistent` programs per SM, each looping over tiles."""
    from flashgen.targets.triton.codegen import grid

    wl = flashgen.workload("gemm", M=4096, N=4096, K=4096, dtype="bf16")
    s = _schedule(wl, block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, producer_warps=1, persistent=1)
    ks = generate(wl, s)
    assert grid(ks, wl, sm_count=SM90.sm_count) == (SM90.sm_count, 1, 1)
    assert grid(ks, wl, rows=128, sm_count=SM90.sm_count) == (16, 1, 1)  # fewer tiles than SMs: one each
    assert "for pid in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):" in ks.source


def test_sampled_space_holds_both_generators():
    """Drawn at random as the search draws, valid schedules of both generators come out."""
    wl = flashgen.workload("gemm", M=4096, N=6144, K=4096, dtype="bf16")
    space = ScheduleSpace(wl, SM90)
    rng = random.Random(0)
    draws = (space.sample(rng) for _ in range(20000))
    points = [space.flat(p) for p in draws if space.is_valid(p)]
    assert {p["backend"] for p in points} == {0, 1}
    assert {p["producer_warps"] for p in points if p["backend"]} == {0, 1}
    assert {p["consumers"] for p in points if p["backend"]} == {1, 2}


@pytest.mark.parametrize("op, kw, tile", [
    ("gemm", {"dtype": "bf16", "with_bias": "yes", "act": "silu"}, (128, 256, 64, 8, 3, 1)),
    ("gemm", {"dtype": "fp16", "with_residual": "yes", "act": "gelu"}, (64, 128, 64, 4, 4, 0)),
    ("gemm_w8a8", {"dtype": "bf16"}, (128, 128, 128, 8, 4, 1)),
    ("gemm", {"dtype": "bf16"}, (128, 256, 64, 8, 3, 2)),
    ("gemm_fp8", {"dtype": "bf16"}, (64, 256, 128, 4, 3, 0)),
])
def test_aot_build_for_sm90(op, kw, tile):
    bm, bn, bk, warps, stages, walk = tile  # walk: 0 no producer warp, 1 one, 2 one with persistent programs
    wl = flashgen.workload(op, M=300, N=1000, K=1024, **kw)
    producer = int(walk > 0)
    s = _schedule(wl, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, producer_warps=producer,
                  persistent=int(walk == 2))
    k = flashgen.compile(wl, SM90, schedule=s)
    ptx = k.asm["ptx"]
    assert k.binary[:4] == b"\x7fELF" and k.binary_kind == "cubin" and ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx
    mma = {"gemm": kw["dtype"].replace("fp16", "f16"), "gemm_w8a8": "s8", "gemm_fp8": "e4m3"}[op]
    assert f".{mma}" in ptx.split("wgmma.mma_async", 1)[1].splitlines()[0]
    assert ("setmaxnreg" in ptx) == bool(producer)  # a copy warp of few registers, MMA warps of many
    assert "griddepcontrol.wait" in ptx  # programmatic dependent launch, as the Triton kernels
    assert k.metadata["backend"] == "triton" and ScheduleSpace(wl, SM90).flat(k.schedule)["backend"] == 1
    src = k.source
    assert "@gluon.jit" in src and "tl." not in src
    assert ("gl.warp_specialize" in src) == bool(producer)


def test_tma_store_stages_the_output_tile():
    """The output tile goes to shared memory (counted against it) and out by a TMA copy."""
    wl = flashgen.workload("gemm", M=300, N=1000, K=1024, dtype="bf16", with_residual="yes")
    s = _schedule(wl, block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, producer_warps=1, tma_store=1)
    k = flashgen.compile(wl, SM90, schedule=s)
    assert "tma.async_copy_shared_to_global(y_desc" in k.source
    assert k.asm["ptx"].count("cp.async.bulk.tensor") == 3  # A and W in, the output tile out
    space = ScheduleSpace(wl, SM90)
    assert "shared memory" in space.why_invalid({**s, "num_stages": 4})  # 4 x 48 KiB ring + 64 KiB tile
    assert space.why_invalid({**s, "num_stages": 4, "tma_store": 0}) is None
    odd = flashgen.workload("gemm", M=300, N=1001, K=1024, dtype="bf16")  # rows 2002 bytes apart
    assert ScheduleSpace(odd, SM90).values("tma_store") == (0,)


def test_two_consumers_take_turns():
    """Two consumer warpgroups, each with its own output tile, alternate at a persistent program's
    tiles: both issue warpgroup MMAs, a turn barrier orders their k loops, the copy warp feeds both."""
    wl = flashgen.workload("gemm", M=2500, N=1000, K=1040, dtype="bf16", with_bias="yes")
    tiles = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4, "producer_warps": 1,
             "persistent": 1, "tma_store": 1}
    one = flashgen.compile(wl, SM90, schedule=_schedule(wl, **tiles))
    two = flashgen.compile(wl, SM90, schedule=_schedule(wl, **tiles, consumers=2))
    src = two.source
    assert "for q in range(first, tiles, 2):" in src and "mbarrier.wait(turn.index(first)" in src
    assert src.count("(_mma_tiles, (") == 2 and "y_tile.index(1), turn, 1)" in src
    # 2 m64 halves x 4 k16 steps per k step, in each consumer
    assert two.asm["ptx"].count("wgmma.mma_async") == 2 * one.asm["ptx"].count("wgmma.mma_async") == 16
    space = ScheduleSpace(wl, SM90)
    s = _schedule(wl, **tiles, consumers=2)
    wide = {**s, "block_m": 64, "block_n": 256, "num_stages": 5}
    assert "shared memory" in space.why_invalid(wide)  # a 5 x 40 KiB ring + 2 x 32 KiB output tiles
    assert space.why_invalid({**wide, "tma_store": 0}) is None


def test_gluon_and_triton_sources_are_different_artifacts():
    wl = flashgen.workload("gemm", M=256, N=1024, K=1024, dtype="bf16")
    tiles = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3}
    g = flashgen.compile(wl, SM90, schedule=_schedule(wl, **tiles))
    t = flashgen.compile(wl, SM90, schedule=_schedule(wl, **tiles, backend=0))
    assert g.metadata["cache_key"] != t.metadata["cache_key"] and "@triton.jit" in t.source


def test_gluon_schedule_refused_where_it_cannot_build():
    wl = flashgen.workload("gemm", M=256, N=1024, K=1024, dtype="bf16")
    s = {**ScheduleSpace(wl, get_target("sm_80")).flat(ScheduleSpace(wl, get_target("sm_80")).default()), "backend": 1}
    with pytest.raises(FlashgenError, match="Gluon tiles build for NVIDIA sm_90"):
        flashgen.compile(wl, "sm_80", schedule=s)


PREFILL = {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3, "tma": 0, "backend": 1, "consumers": 2,
           "pingpong": 1, "persistent": 0}


def _prefill(d=128, dtype="bf16", mod="none", hq=32, hkv=8):
    return flashgen.workload("flash_prefill_attention", T=1000, B=3, Hq=hq, Hkv=hkv, D=d, dtype=dtype, mod=mod)


@pytest.mark.parametrize("target", ["sm_80", "gfx942"])
def test_prefill_offered_on_sm90_packed_only(target):
    """The Gluon prefill serves packed sequences on sm_90; a prefix in a paged cache stays Triton's."""
    knobs = ScheduleSpace(_prefill(), SM90).knobs()
    assert knobs["backend"] == (0, 1) and knobs["consumers"] == (1, 2) and knobs["pingpong"] == (0, 1)
    assert knobs["persistent"] == (0, 1)
    other = ScheduleSpace(_prefill(), get_target(target)).knobs()
    assert other["backend"] == other["persistent"] == (0,)
    chunked = flashgen.workload("chunked_prefill_attention", T=2000, B=5, Hq=32, Hkv=8, D=128, BS=16, NB=1024,
                                MAXB=128, dtype="bf16")
    assert ScheduleSpace(chunked, SM90).values("backend") == (0,)


@pytest.mark.parametrize("wl, over, why", [
    (_prefill(), {"block_m": 64}, "block_m = 64 x consumers"),
    (_prefill(), {"num_warps": 8}, "one warpgroup"),
    (_prefill(), {"tma": 1}, "own TMA copies"),
    (_prefill(), {"consumers": 1, "block_m": 64}, "ping-pong takes two consumers"),
    (_prefill(), {"num_stages": 1}, "num_stages >= 2"),
    (_prefill(d=96), {}, "power-of-two head dims"),
    (_prefill(d=256), {}, "registers"),
    (_prefill(), {"backend": 0}, "serve the Gluon prefill"),
    (_prefill(), {"backend": 0, "consumers": 1, "pingpong": 0, "persistent": 1}, "serve the Gluon prefill"),
])
def test_prefill_rules_name_what_is_wrong(wl, over, why):
    space = ScheduleSpace(wl, SM90)
    assert why in (space.why_invalid({**PREFILL, **over}) or ""), space.why_invalid({**PREFILL, **over})


def test_sampled_prefill_space_holds_both_generators():
    space = ScheduleSpace(_prefill(), SM90)
    rng, knobs = random.Random(0), space.knobs()
    points = [p for p in ({k: rng.choice(v) for k, v in knobs.items()} for _ in range(5000)) if space.is_valid(p)]
    assert {p["backend"] for p in points} == {0, 1}
    assert {(p["consumers"], p["pingpong"]) for p in points if p["backend"]} == {(1, 0), (2, 0), (2, 1)}
    assert {p["persistent"] for p in points if p["backend"]} == {0, 1}
    assert {p["persistent"] for p in points if not p["backend"]} == {0}


@pytest.mark.parametrize("d, dtype, mod, over", [
    (128, "bf16", "none", {}),
    (128, "fp16", "softcap", {"pingpong": 0}),
    (64, "bf16", "alibi", {"block_n": 128}),
    (128, "bf16", "window", {"consumers": 1, "block_m": 64, "pingpong": 0, "num_stages": 2, "block_n": 128}),
    (128, "bf16", "none", {"persistent": 1}),
])
def test_prefill_aot_build_for_sm90(d, dtype, mod, over):
    """The consumers' logits and weighted values are warpgroup MMAs on TMA-copied tiles, fed by a copy
    warp of few registers; masks only where a key tile reaches the diagonal under the plain causal mask."""
    wl = _prefill(d, dtype, mod)
    s = {**PREFILL, **over}
    assert ScheduleSpace(wl, SM90).why_invalid(s) is None
    k = flashgen.compile(wl, SM90, schedule=s)
    ptx, src = k.asm["ptx"], k.source
    assert k.binary[:4] == b"\x7fELF" and ".target sm_90a" in ptx and "tl." not in src
    assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx and "mbarrier.try_wait" in ptx
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    # per consumer: the first tile's logits, then each step's logits and values, then the last values;
    # a [64, BLOCK_N] x D logits MMA is D / 16 instructions, a [64, D] x BLOCK_N values MMA BLOCK_N / 16
    per = 2 * d // 16 + 2 * s["block_n"] // 16
    assert len(mma) == s["consumers"] * per and all(f".{dtype.replace('fp16', 'f16')}" in x for x in mma)
    assert src.count("(_attend_rows, (") == s["consumers"]
    # every partition walks the program's tiles: the copy warp's queries wait for the logits before
    assert src.count("for i in range(0, gl.cdiv(tiles, gl.num_programs(0))):") == 2
    assert "mbarrier.wait(q_free, (i & 1) ^ 1)" in src and "mbarrier.arrive(q_free)" in src
    assert ("mbarrier.wait(turn.index(first)" in src) == bool(s["pingpong"])
    assert ("if j * BLOCK_N + BLOCK_N > r0:" in src) == (mod != "window")
    assert ("/ softcap)" in src) == (mod == "softcap")


def test_prefill_programs_as_tritons():
    """The Gluon prefill numbers its query tiles as the Triton kernel does, one program each (heads
    fastest), or a persistent program per SM walking one tile of each round, every other round backwards."""
    from flashgen.targets.triton.codegen import grid

    wl = _prefill()
    g = generate(wl, PREFILL)
    t = generate(wl, {**PREFILL, "backend": 0, "consumers": 1, "pingpong": 0, "num_warps": 8})
    assert g.dialect == "gluon" and t.dialect == "triton"
    tiles = -(-1000 // 128) + 3
    assert grid(t, wl) == (tiles, 32, 1) and grid(g, wl, sm_count=132) == (tiles * 32, 1, 1)
    walk = generate(wl, {**PREFILL, "persistent": 1})
    assert grid(walk, wl, sm_count=132) == (132, 1, 1)
    assert grid(walk, _prefill(hq=4, hkv=1), sm_count=132) == (tiles * 4, 1, 1)  # fewer tiles than SMs
    assert "tiles = gl.minimum(gl.cdiv(T, BLOCK_M) + B, T) * Hq" in walk.source


INT4 = {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4, "group_m": 8, "split_k": 1,
        "persistent": 0, "tma": 0, "early_load": 0, "backend": 1, "producer_warps": 1, "ptx_unpack": 1,
        "operand_scale": 1, "consumers": 1, "tma_store": 0, "dequant_first": 0, "dequant_chunks": 1}


def _w4(m=19, n=1000, k=1152, **kw):
    return flashgen.workload("gemm_w4a16", **{"M": m, "N": n, "K": k, "G": 128, "dtype": "bf16", **kw})


@pytest.mark.parametrize("m, over, why", [
    (300, {"producer_warps": 0}, "producer warp"),
    (300, {"persistent": 1}, "one program per tile"),
    (300, {"ptx_unpack": 0, "operand_scale": 0}, "PTX"),
    (300, {"operand_scale": 0}, "operand_scale 1"),
    (300, {"block_k": 256}, "one block of 128 k"),
    (16, {"block_m": 8}, "at least 16 activation rows"),
    (300, {"block_n": 64, "num_warps": 8}, "whole warpgroups"),
    (300, {"num_stages": 3, "block_m": 256, "block_n": 128, "num_warps": 8}, "epilogue scratch"),  # 280 KiB on an H200
])
def test_int4_rules_name_what_is_wrong(m, over, why):
    space = ScheduleSpace(_w4(m=m), SM90)
    assert space.why_invalid(INT4) is None
    assert why in (space.why_invalid({**INT4, **over}) or ""), space.why_invalid({**INT4, **over})


def test_int4_per_channel_scales_apply_to_the_sum():
    wl = _w4(G=1152, group="channel")
    space = ScheduleSpace(wl, SM90)
    assert space.why_invalid({**INT4, "operand_scale": 0}) is None
    assert "operand_scale" in space.why_invalid(INT4)


@pytest.mark.parametrize("kw, over", [
    ({}, {}),
    ({"dtype": "fp16", "with_residual": "yes", "M": 64}, {"split_k": 4, "block_m": 64}),
    ({"G": 1152, "group": "channel", "with_bias": "yes"}, {"operand_scale": 0, "split_k": 2}),
    ({"G": 256, "M": 300, "K": 1280}, {"block_n": 128, "num_warps": 8, "block_m": 128, "num_stages": 3}),
])
def test_int4_aot_build_for_sm90(kw, over):
    """The unpacked codes are the warpgroup MMA's register operand (16-deep MMAs, one per code
    position), shared memory holds the packed words and activations copied by TMA, each pair of codes
    is one PRMT and one LOP3 in PTX, and a copy warp of few registers issues the copies."""
    wl = _w4(**kw)
    s = {**INT4, **over}
    assert ScheduleSpace(wl, SM90).why_invalid(s) is None
    k = flashgen.compile(wl, SM90, schedule=s)
    ptx, src = k.asm["ptx"], k.source
    assert k.binary[:4] == b"\x7fELF" and ".target sm_90a" in ptx and "tl." not in src
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    # each warpgroup's 64 weight rows: 8 code positions of one 128-k block per k step
    assert len(mma) == 8 * s["block_n"] // (16 * s["num_warps"])
    operand = kw.get("dtype", "bf16").replace("fp16", "f16")
    assert all(f"m64n{s['block_m']}k16.f32.{operand}.{operand} {{" in x and "}, {%r" in x for x in mma)  # A in registers
    assert ptx.count("cp.async.bulk.tensor") == 3  # the words and two 64-k halves of the activations
    assert "setmaxnreg" in ptx and "prmt.b32" in ptx and "lop3.b32" in ptx
    assert ("_scaled(words, sc_w)" in src) == bool(s["operand_scale"])
    assert ("atomic_add(done_ptr" in src) == (s["split_k"] > 1)
    assert k.metadata["backend"] == "triton" and ScheduleSpace(wl, SM90).flat(k.schedule)["backend"] == 1
    # a k step's MMAs are issued together and awaited once
    assert ptx.count("wgmma.wait_group.sync.aligned") == 1 and ptx.count("wgmma.commit_group") == 8
    assert "C7515" not in _ptxas_info(ptx)  # ptxas keeps them asynchronous (no serialized warpgroup MMAs)


def _ptxas_info(ptx: str) -> str:
    """What Triton's own ptxas says of a PTX module for sm_90a (-v): registers, and any performance loss."""
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True)
    return run.stderr


LANES = {"variant": "gluon_lanes", "block_m": 64, "block_n": 128, "block_k": 128, "num_warps": 4, "num_stages": 4,
         "group_m": 8, "split_k": 1}


def _w4a8(m=256, n=1000, k=1152, g=128, pack="lanes"):
    return flashgen.workload("gemm_w4a8", M=m, N=n, K=k, G=g or k, dtype="bf16", group="group" if g else "channel",
                             pack=pack)


def test_lanes_offered_on_sm90_for_lanes_codes_and_int8_rows_16_bytes_apart():
    assert "gluon_lanes" in ScheduleSpace(_w4a8(), SM90).forms()
    assert "gluon_lanes" in ScheduleSpace(_w4a8(g=None), SM90).forms()
    for other in ("sm_80", "gfx942"):
        assert "gluon_lanes" not in ScheduleSpace(_w4a8(), get_target(other)).forms()
    assert "gluon_lanes" not in ScheduleSpace(_w4a8(pack="k128"), SM90).forms()  # words of 128 k: not lanes
    assert "gluon_lanes" not in ScheduleSpace(_w4a8(k=1000, g=None), SM90).forms()  # rows 1000 bytes apart: no TMA
    form = ScheduleSpace(_w4a8(), SM90).forms()["gluon_lanes"]
    assert set(form["block_k"]) == {64, 128, 256} and max(form["block_m"]) <= 128


@pytest.mark.parametrize("over, why", [
    ({"block_k": 32}, "whole byte tiles of 64 k"),
    ({"block_k": 512}, "at most 128 bytes"),
    ({"block_m": 256}, "16 to 128 activation rows"),
    ({"block_n": 64, "num_warps": 8}, "whole warpgroups"),
    ({"block_m": 128, "block_k": 256}, "registers a thread"),
    ({"block_m": 128, "num_warps": 8, "block_k": 256, "num_stages": 5}, "shared memory"),
])
def test_lanes_rules_name_what_is_wrong(over, why):
    space = ScheduleSpace(_w4a8(), SM90)
    assert space.why_invalid(LANES) is None
    assert why in (space.why_invalid({**LANES, **over}) or ""), space.why_invalid({**LANES, **over})
    flat = space.flat(LANES)
    assert flat["lanes"] == flat["backend"] == flat["producer_warps"] == flat["operand_scale"] == 1
    assert "lanes 1" in space.why_invalid({**flat, "lanes": 0, "operand_scale": 0})
    assert "producer warp" in space.why_invalid({**flat, "producer_warps": 0})


@pytest.mark.parametrize("g, over", [
    (128, {}),
    (32, {"block_k": 256, "block_m": 16, "block_n": 64}),  # a scale per 32-k block
    (None, {"split_k": 2, "block_m": 32}),
    (64, {"block_m": 128, "num_warps": 8}),
])
def test_lanes_aot_build_for_sm90(g, over):
    """The unpacked bytes are the int8 warpgroup MMA's register operand (two 32-deep MMAs per 64-k byte
    tile), shared memory holds packed bytes and activations copied by TMA and no unpacked tile, the k
    loop takes about one integer instruction per code it unpacks (per four: the lanes' LOP3, a shift
    for half of them, the scale's IMAD and the sign flip; 120 for 128 codes a thread at this commit),
    and ptxas keeps the MMAs asynchronous."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import loop_opcodes

    wl, s = _w4a8(g=g), {**LANES, **over}
    assert ScheduleSpace(wl, SM90).why_invalid(s) is None
    k = flashgen.compile(wl, SM90, schedule=s)
    ptx, src = k.asm["ptx"], k.source
    mma = [line for line in ptx.splitlines() if "wgmma.mma_async" in line]
    assert len(mma) == s["block_k"] // 32 * s["block_n"] // (16 * s["num_warps"])
    assert all(f"m64n{s['block_m']}k32.s32.s8.s8 {{" in x and "}, {%r" in x for x in mma)  # A in registers
    assert src.count("tma.async_copy_global_to_shared") == 1 + max(1, s["block_k"] // 128)  # bytes, activations
    assert ("atomic_add(done_ptr" in src) == (s.get("split_k", 1) > 1)
    assert ("w_group_ptr" in src) == bool(g)
    loop = loop_opcodes(k.binary)
    assert loop["IGMMA.64"] == len(mma) and not any(op.startswith("STS") for op in loop), loop
    codes = s["block_n"] * s["block_k"] // (32 * s["num_warps"])  # a thread's share of a k step
    # (besides a PRMT per row and scale, putting the scale in each byte of a register; groups shallower
    # than the k step add a scale's load and constant per group and row)
    if g is None or g >= s["block_k"]:
        assert sum(n for op, n in loop.items() if op.startswith(("LOP3", "IMAD", "SHF"))) <= codes * 1.1, loop
    assert "C7515" not in _ptxas_info(ptx)


def test_lanes_default_from_256_rows_on_sm90():
    """From GLUON_LANES_DEFAULT_M rows, lanes codes default to the Gluon lanes tile on sm_90: 128 x 256
    where such tiles fill the SMs, 128 x 128 where those would not, 64 x 128 where 128 x 128 would fill
    fewer than half; below, and on other targets, the Triton lanes tile (or the weight dequantized
    first at thousands of rows)."""
    def default(m, n, target="h100"):
        return ScheduleSpace(_w4a8(m=m, n=n, k=4096), get_target(target)).default()

    assert default(4096, 4096) == {**default(4096, 4096), "variant": "gluon_lanes", "block_m": 128, "block_n": 256}
    assert (default(256, 28672)["block_m"], default(256, 28672)["block_n"]) == (128, 256)  # 224 tiles
    assert (default(256, 4096)["block_m"], default(256, 4096)["block_n"]) == (64, 128)  # 128 tiles, not 32 or 64
    assert (default(256, 6144)["block_m"], default(256, 6144)["block_n"]) == (128, 128)  # 96 tiles, not 192
    narrow = ScheduleSpace(_w4a8(m=515, n=40, k=576, g=32), SM90)  # 40 columns: one warpgroup's 64 weight rows
    assert narrow.default() == {**narrow.default(), "variant": "gluon_lanes", "block_n": 64, "num_warps": 4}
    assert narrow.is_valid(narrow.default())
    assert default(64, 4096)["variant"] == "tile_lanes_scaled"
    assert default(256, 4096, "sm_80")["variant"] == "tile_lanes_scaled"
    assert default(4096, 4096, "sm_80")["variant"] == "dq_tile"
