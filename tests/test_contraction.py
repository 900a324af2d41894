"""The contraction class: quantizer and packer, interpreter numerics and AOT builds of every GEMM op."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import flashgen
from flashgen.errors import FlashgenError
from flashgen.quant import pack_int4, quantize_rtn, unpack_int4
from flashgen.schedules.space import ScheduleSpace
from flashgen.kernel_classes import current_schedule
from flashgen.targets import get_target

W4 = [dict(G=32), dict(G=64, zp="asym"), dict(G=128), dict(G=320, group="channel", zp="asym")]
W4A8 = [dict(G=32), dict(G=128), dict(G=320, group="channel")]
CASES = [("gemm", {}), ("gemm_w8a16", {})] + [("gemm_w4a16", kw) for kw in W4] + [("gemm_w8a8", {})] + \
    [("gemm_w4a8", kw) for kw in W4A8]

# sm_90 SASS budgets of the int4 kernel kinds the tests below build: the k loop's static instructions at
# most (measured plus about 5%), and opcode families it must hold; what the generated source looks like
# is free, the machine code is what counts.
BUDGETS = {"int4_mma": (580, ("HGMMA",)), "int4_mma_operand_scale": (260, ("HGMMA", "HMUL2")),
           "int4_gemv_pairs_fp16": (750, ("HFMA2",)), "int4_gemv_pairs_bf16": (780, ("HFMA2",)),
           "int4_gemv_quads_fp16": (1125, ("HFMA2",)), "int4_gemv_quads_bf16": (1285, ("HFMA2", "F2FP"))}



def generate(wl, s):
    """The Triton source of `wl` for schedule `s`, flat or in variant form, as `flashgen.compile` reads it."""
    from flashgen.targets.triton.codegen import generate as _generate

    return _generate(wl, current_schedule(wl, s))

def assert_budget(kind: str, binary: bytes) -> None:
    """The k loop of `binary` (an sm_90 cubin) within kind's budget."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import loop_opcodes
    most, needed = BUDGETS[kind]
    loop = loop_opcodes(binary)
    families = {op.split(".")[0] for op in loop}
    assert sum(loop.values()) <= most and set(needed) <= families, (kind, sum(loop.values()), loop)


def test_pack_round_trip():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (24, 200), generator=g, dtype=torch.uint8)  # K pads to 256
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (24, 32)
    assert torch.equal(unpack_int4(packed, 200), codes)
    assert (packed < 0).any()  # code 8..15 in the top nibble: the word's sign bit is data
    words = packed.to(torch.int64) & 0xFFFFFFFF
    for k in (0, 15, 16, 127, 128, 150, 199):  # word 16*b + i, nibble j holds k = 128*b + 16*j + i
        b, j, i = k // 128, k % 128 // 16, k % 16
        assert torch.equal((words[:, 16 * b + i] >> (4 * j)) & 15, codes[:, k].to(torch.int64))
    assert not (words[:, 16:] >> 4 * 5).any()  # codes 5-7 of block 1 are k >= 208: zero padding
    with pytest.raises(FlashgenError, match="do not pack K=100"):
        unpack_int4(packed, 100)
    with pytest.raises(FlashgenError, match="0..15"):
        pack_int4(codes.to(torch.int16) + 1)


@pytest.mark.parametrize("bits, group, symmetric", [(4, 32, True), (4, 128, False), (4, None, True), (8, None, True)])
def test_rtn_quantizer_error_is_within_half_a_step(bits, group, symmetric):
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(1))
    q = quantize_rtn(w, bits, group, symmetric)
    deq = q.dequantize()
    step = q.scales.to(torch.float64).repeat_interleave(q.group, 1)
    assert ((deq - w.double()).abs() <= step / 2 + 1e-9).all()
    if bits == 4:
        assert q.codes.max() <= 15 and q.codes.min() >= 0
    else:
        assert q.codes.abs().max() <= 127


def test_rtn_quantizer_rejects_bad_shapes():
    with pytest.raises(FlashgenError, match="multiple of the group"):
        quantize_rtn(torch.randn(4, 100), 4, 32)


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("op, kw", CASES, ids=[f"{o}-{'-'.join(f'{k}{v}' for k, v in kw.items())}" for o, kw in CASES])
def test_interpreter_numerics(interpreter, op, kw, m):
    """fp16 (bf16 tl.dot is wrong in Triton's interpreter: bf16 numerics run on the GPU); N and K tails
    (int4 weights: K=320 pads the last block of 128 k, and the k tile of 128 runs past K)."""
    k = 200 if "G" not in kw else 384 if kw["G"] == 128 else 320
    wl = flashgen.workload(op, M=m, N=40, K=k, dtype="fp16", **kw)
    s = {"block_m": 16, "block_n": 32, "block_k": 128 if "G" in kw else 64, "num_warps": 4, "num_stages": 2,
         "group_m": 8}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s)
    for c in interpreter.check(wl, s, "h200", seed=m):
        assert c.ok, c


GEMV = [("gemm_w4a16", dict(G=64), 1, 128), ("gemm_w4a16", dict(G=64, zp="asym"), 2, 256),
        ("gemm_w4a16", dict(G=256, group="channel", zp="asym"), 4, 128), ("gemm_w4a16", dict(G=32), 2, 128),
        ("gemm_w4a16", dict(G=128), 1, 256), ("gemm", {}, 2, 64), ("gemm_w8a8", {}, 4, 32),
        ("gemm_w4a8", dict(G=64), 2, 128), ("gemm_w4a8", dict(G=256, group="channel"), 1, 256)]


@pytest.mark.parametrize("op, kw, block_m, block_k", GEMV, ids=[f"{o}-{'-'.join(map(str, kw.values()))}-m{bm}-k{bk}" for o, kw, bm, bk in GEMV])
def test_gemv_tiles_numerics(interpreter, op, kw, block_m, block_k):
    """Tiles of fewer than 16 rows sum products on the ALUs; int4 codes take the reshape-free path,
    the scale once per segment of codes sharing a group (eight codes of a word for G >= 128, fewer for
    G=32 and 64). M=3 leaves a partial row tile, N=40 a partial column tile, G=128 under a 256-deep
    k tile a partial k tile."""
    k = 256 if "G" in kw else 200
    wl = flashgen.workload(op, M=3, N=40, K=k, dtype="fp16", **kw)
    s = {"block_m": block_m, "block_n": 32, "block_k": block_k, "num_warps": 2, "num_stages": 2, "group_m": 1}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s), ScheduleSpace(wl, get_target("h200")).why_invalid(s)
    for c in interpreter.check(wl, s, "h200", seed=block_m):
        assert c.ok, c


def test_gemv_tiles_without_copy_pipeline(interpreter):
    """One stage: NVIDIA GEMV tiles load weights straight into registers (16-byte LDG, no cp.async
    and no barrier in a 1024-deep k loop); matrix tiles keep their copy pipeline of 2 or more stages.
    Numerics: M=3, N=40 and K=1000 leave partial row, column and k tiles."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import loop_opcodes
    h200 = get_target("h200")
    s = {"block_m": 1, "block_n": 16, "block_k": 1024, "num_warps": 4, "num_stages": 1, "group_m": 1}
    gemv = flashgen.workload("gemm", M=1, N=4096, K=4096, dtype="bf16")
    assert 1 in ScheduleSpace(gemv, h200).knobs()["num_stages"]
    assert "at least 2 stages" in ScheduleSpace(gemv, h200).why_invalid({**s, "block_m": 16})
    assert 1 not in ScheduleSpace(gemv.with_dims(M=17), h200).knobs()["num_stages"]
    loop = loop_opcodes(flashgen.compile(gemv, "h200", schedule=s).binary)
    assert loop.get("LDG.E.128", 0) >= 16 and not any(o.startswith(("LDGSTS", "BAR")) for o in loop), loop
    for op, kw, bm in (("gemm", {}, 2), ("gemm_w4a16", dict(G=128, zp="asym"), 4)):
        wl = flashgen.workload(op, M=3, N=40, K=1000 if op == "gemm" else 1024, dtype="fp16", **kw)
        t = {**s, "block_m": bm, "block_k": 512, "num_warps": 2}
        assert ScheduleSpace(wl, h200).is_valid(t), ScheduleSpace(wl, h200).why_invalid(t)
        for c in interpreter.check(wl, t, "h200", seed=bm):
            assert c.ok, c


EARLY = [("gemm", {}, 1, 64, 200), ("gemm", {}, 2, 256, 200), ("gemm_w4a16", dict(G=64, zp="asym"), 2, 128, 384),
         ("gemm_w4a16", dict(G=128), 1, 256, 256), ("gemm_w8a8", {}, 4, 32, 40)]


@pytest.mark.parametrize("op, kw, block_m, block_k, k", EARLY, ids=[f"{o}-{'-'.join(map(str, kw.values()))}-m{bm}-k{bk}-K{k}" for o, kw, bm, bk, k in EARLY])
def test_gemv_early_load_numerics(interpreter, op, kw, block_m, block_k, k):
    """early_load peels the first k step: its weights load before the wait, x after. K=200 under 64-
    and 256-deep k steps (a tail step, and a single partial step), int4 groups with zero points over
    three k steps, int8 weights with per-token scales; M=3 and N=40 leave partial row and column tiles."""
    wl = flashgen.workload(op, M=3, N=40, K=k, dtype="fp16", **kw)
    s = {"block_m": block_m, "block_n": 32 if block_k <= 128 else 16, "block_k": block_k, "num_warps": 2,
         "num_stages": 2, "group_m": 1, "early_load": 1}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s), ScheduleSpace(wl, get_target("h200")).why_invalid(s)
    for c in interpreter.check(wl, s, "h200", seed=k):
        assert c.ok, c


def test_gemv_early_load_rules_and_order():
    """The knob exists where PDL does (sm_90 GEMV tiles, unsplit, not persistent). In the sm_90 binary
    the first weight load is issued before the wait and every x load after it; in the source nothing
    but weight tensors is read before the wait."""
    wl = flashgen.workload("gemm_w4a16", M=1, N=4096, K=4096, G=128, dtype="bf16")
    assert ScheduleSpace(wl, get_target("h200")).values("early_load") == (0, 1)
    for t in ("a100", "mi300x"):
        assert ScheduleSpace(wl, get_target(t)).values("early_load") == (0,)
    assert ScheduleSpace(flashgen.workload("gemm", M=64, N=512, K=512), get_target("h200")).values("early_load") == (0,)
    space = ScheduleSpace(wl, get_target("h200"))
    s = {"block_m": 1, "block_n": 16, "block_k": 1024, "num_warps": 4, "num_stages": 3, "group_m": 1, "early_load": 1}
    assert space.is_valid(s)
    assert "early weight loads" in space.why_invalid({**s, "split_k": 2, "block_k": 512})
    src = generate(wl, s).source
    before = src[:src.index("gdc_wait")]
    assert "w_packed_ptr" in before and "tl.load(scales_ptr" in before and "tl.load(x_ptr" not in before
    assert "tl.load(x_ptr" in src[src.index("gdc_wait"):]
    ptx = flashgen.compile(wl, "sm_90", schedule=s).asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(ptx) if "griddepcontrol.wait" in line)
    assert any("ld.global" in line or "cp.async" in line for line in ptx[:wait])
    base = flashgen.compile(wl, "sm_90", schedule={**s, "early_load": 0}).asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(base) if "griddepcontrol.wait" in line)
    assert not any("ld.global" in line or "cp.async" in line for line in base[:wait])


SPLITS = [("gemm", {}, 16, 32, 2), ("gemm_w8a8", {}, 16, 32, 4), ("gemm_w4a16", dict(G=64, zp="asym"), 1, 128, 2),
          ("gemm_w4a16", dict(G=32), 16, 128, 2), ("gemm", dict(with_bias="yes", act="silu", with_residual="yes"), 2, 32, 4)]


@pytest.mark.parametrize("op, kw, block_m, block_k, split_k", SPLITS,
                         ids=[f"{o}-{'-'.join(map(str, kw.values()))}-m{bm}-s{sk}" for o, kw, bm, _, sk in SPLITS])
def test_split_k_numerics(interpreter, op, kw, block_m, block_k, split_k):
    """Splits of K merged by the last split of each tile, in matrix and ALU tiles, int32 partials for
    int8 operands, the epilogue applied once to the merged sum; K=248 (a partial k tile) or 512, and
    M=17 or 5 (partial row tiles)."""
    k = 512 if "G" in kw else 248
    wl = flashgen.workload(op, M=17 if block_m == 16 else 5, N=40, K=k, dtype="fp16", **kw)
    s = {"block_m": block_m, "block_n": 32, "block_k": block_k, "num_warps": 2, "num_stages": 2, "group_m": 1,
         "split_k": split_k}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s)
    for c in interpreter.check(wl, s, "h200", seed=split_k):
        assert c.ok, c


def test_persistent_tiles_numerics(interpreter):
    """Persistent programs (one per SM: 132 on the h200 target) walking 200 tiles, some two each, with
    partial row and column tiles and a fused epilogue; and int4 matrix tiles walked the same way."""
    wl = flashgen.workload("gemm", M=150, N=312, K=64, dtype="fp16", with_bias="yes", act="silu")
    s = {"block_m": 16, "block_n": 16, "block_k": 32, "num_warps": 2, "num_stages": 2, "group_m": 8, "split_k": 1,
         "persistent": 1}
    space = ScheduleSpace(wl, get_target("h200"))
    assert space.is_valid(s) and "split_k must be 1" in space.why_invalid({**s, "split_k": 2})
    from flashgen.targets.triton.codegen import grid
    ks = generate(wl, s)
    assert grid(ks, wl, sm_count=132) == (132, 1, 1) and grid(ks, wl) == (200, 1, 1)
    for c in interpreter.check(wl, s, "h200", seed=9):
        assert c.ok, c
    for target in ("sm_90", "gfx942"):
        assert flashgen.compile(wl, target, schedule=s).binary[:4] == b"\x7fELF"
    w4 = flashgen.workload("gemm_w4a16", M=150, N=220, K=128, G=64, dtype="fp16")  # 10 x 14 tiles
    for c in interpreter.check(w4, {**s, "block_k": 128}, "h200", seed=10):
        assert c.ok, c


TMA = [("gemm", {}, 1, 0), ("gemm", dict(with_bias="yes", act="silu"), 2, 0), ("gemm", {}, 1, 1), ("gemm_w8a8", {}, 1, 0)]


@pytest.mark.parametrize("op, kw, split_k, persistent", TMA, ids=[f"{o}-{len(kw)}-s{sk}-p{p}" for o, kw, sk, p in TMA])
def test_tma_tiles_numerics(interpreter, op, kw, split_k, persistent):
    """A and W tiles copied by TMA descriptors (zero-filled past M, N and K: M=37, N=40, K=144 leave
    partial tiles on every side), with split-K, persistent programs and a fused epilogue."""
    wl = flashgen.workload(op, M=37, N=40, K=144, dtype="fp16", **kw)
    s = {"block_m": 16, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2, "group_m": 8,
         "split_k": split_k, "persistent": persistent, "tma": 1}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s)
    for c in interpreter.check(wl, s, "h200", seed=11):
        assert c.ok, c


def test_tma_rules_and_build():
    """TMA tiles are offered on sm_90 for operands without a prologue, copied by UTMALDG; never on
    sm_80 or AMD, nor for int4 weights or ALU tiles."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import opcodes, summary
    wl = flashgen.workload("gemm", M=256, N=512, K=512, dtype="bf16")
    assert ScheduleSpace(wl, get_target("h200")).values("tma") == (0, 1)
    assert ScheduleSpace(wl, get_target("a100")).values("tma") == (0,)
    assert ScheduleSpace(wl, get_target("mi300x")).values("tma") == (0,)
    w4 = flashgen.workload("gemm_w4a16", M=256, N=512, K=512, G=128, dtype="bf16")
    assert ScheduleSpace(w4, get_target("h200")).values("tma") == (0,)
    s = {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3, "group_m": 8, "tma": 1}
    gemv = flashgen.workload("gemm", M=1, N=512, K=512, dtype="bf16")
    assert "TMA" in ScheduleSpace(gemv, get_target("h200")).why_invalid({**s, "block_m": 1, "block_n": 64})
    k = flashgen.compile(wl, "sm_90", schedule=s)
    sass = summary(opcodes(k.binary))
    assert sass["tma"] > 0 and sass["wgmma"] > 0 and sass["loads_16B"] == 0, sass
    assert k.metadata["global_scratch_bytes"] > 0


def test_split_k_rules_and_older_records():
    """A schedule recorded before split_k existed is read as split_k=1; splits need k steps to share."""
    space = ScheduleSpace(flashgen.workload("gemm", M=256, N=4096, K=1024), get_target("h200"))
    old = {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3, "group_m": 8}
    assert space.is_valid(old) and space.complete(old)["split_k"] == 1 and space.complete(old)["persistent"] == 0
    assert space.flat(old)["tma"] == 0
    assert "k steps" in space.why_invalid({**old, "block_k": 128, "split_k": 8})
    assert space.is_valid({**old, "split_k": 8})
    k = flashgen.compile(space.workload, "sm_90", schedule={**old, "split_k": 4})
    assert "atom.global" in k.asm["ptx"] and k.metadata["schedule"]["split_k"] == 4
    # a one-stage GEMV tile's best form is one deep k step: its splits may hold one each
    gemv = ScheduleSpace(flashgen.workload("gemm_w4a16", M=1, N=4096, K=4096, G=128, dtype="fp16"), get_target("h200"))
    one = {"block_m": 1, "block_n": 16, "block_k": 2048, "num_warps": 4, "num_stages": 1, "group_m": 1, "ptx_unpack": 2,
           "split_k": 2}
    assert gemv.is_valid(one) and "k steps" in gemv.why_invalid({**one, "num_stages": 3})
    assert "1 k step of 2048" in gemv.why_invalid({**one, "split_k": 4})
    k = flashgen.compile(gemv.workload, "sm_90", schedule=one)
    assert "atom.global" in k.asm["ptx"] and "cp.async" not in k.asm["ptx"]


@pytest.mark.parametrize("target", ["h200", "a100", "mi300x", "mi250"])
def test_gemv_int4_default_builds_without_matrix_instructions(target):
    """At M=1 the analytic default of W4A16 is a one-row ALU tile on every target: on NVIDIA quads of
    words in fp16 pairs loaded straight into registers, elsewhere fp32 codes, pipelined."""
    wl = flashgen.workload("gemm_w4a16", M=1, N=4096, K=4096, G=128, dtype="bf16")
    t = get_target(target)
    s = ScheduleSpace(wl, t).flat(ScheduleSpace(wl, t).default())
    assert s["block_m"] == 1
    k = flashgen.compile(wl, t, schedule=s)
    asm = k.asm["ptx"] if t.vendor == "nvidia" else k.asm["amdgcn"]
    assert "mma" not in asm and "mfma" not in asm
    if t.vendor == "nvidia":
        assert s["ptx_unpack"] == 2 and s["num_stages"] == 1
        assert "fma.rn.f16x2" in asm and "cp.async" not in asm
    else:
        assert s["num_stages"] > 1


def test_gemv_int4_source_has_no_reshape():
    """The reshape-free GEMV keeps codes in the loaded words' layout: no tl.reshape, no tl.dot, and the
    scale applied to partial sums, not to each code."""
    wl = flashgen.workload("gemm_w4a16", M=1, N=256, K=512, G=128, dtype="bf16")
    src = generate(wl, {"block_m": 1, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 2,
                        "group_m": 1}).source
    assert "tl.reshape" not in src and "tl.dot" not in src
    assert re.search(r"part0 \+= \(.*\) \* t\d+\n", src)  # one scale multiply per word's sum
    k = flashgen.compile(wl, "sm_90", schedule={"block_m": 1, "block_n": 64, "block_k": 128, "num_warps": 4,
                                                "num_stages": 2, "group_m": 1})
    assert "mma" not in k.asm["ptx"] and k.binary[:4] == b"\x7fELF"


@pytest.mark.parametrize("target", ["sm_80", "sm_90", "gfx90a", "gfx942"])
@pytest.mark.parametrize("op, kw", CASES + [("gemm_fp8", {})], ids=[o + str(len(kw)) for o, kw in CASES + [("gemm_fp8", {})]])
def test_aot_uses_matrix_instructions(op, kw, target):
    wl = flashgen.workload(op, M=256, N=512, K=512, dtype="bf16", **({**kw, "G": 512} if kw.get("group") == "channel" else kw))
    t = get_target(target)
    if any(wl.tensor_dtype(x.name) not in t.dtypes for x in wl.op.inputs):
        with pytest.raises(FlashgenError, match="does not support fp8e4m3"):
            flashgen.compile(wl, t)
        return
    k = flashgen.compile(wl, t)
    assert k.binary[:4] == b"\x7fELF"
    int8 = op in ("gemm_w8a8", "gemm_w4a8")  # int8 operands: the integer instructions, int32 sums
    if target == "sm_90":
        assert re.search(r"wgmma\.mma_async\S*" + (r"\.s32\.s8\.s8" if int8 else ""), k.asm["ptx"])
    elif target == "sm_80":
        assert re.search(r"mma\.sync\S*" + (r"\.s32\.s8\.s8" if int8 else ""), k.asm["ptx"])
    else:
        assert re.search(r"v_mfma" + (r"_i32_\w*i8" if int8 else ""), k.asm["amdgcn"])


@pytest.mark.parametrize("op", ["gemm", "gemm_w8a8", "gemm_fp8"])
def test_dense_default_halves_rows_where_128_row_tiles_idle_half_the_sms(op):
    """On sm_90, 256 rows of a 4096-wide weight in 128 x 128 tiles are 64 programs on 132 SMs: the
    default takes 64-row tiles 128 k deep over 4 stages (the records: bf16 down 55.6 against 110.9 us on
    the H200); wider weights keep the 128-row tiles, and targets without those records keep theirs."""
    def default(t, m, n, k):
        s = ScheduleSpace(flashgen.workload(op, M=m, N=n, K=k, dtype="bf16"), get_target(t)).default()
        return s["block_m"], s["block_n"], s["block_k"], s["num_stages"]
    for t in ("h100", "h200"):
        assert default(t, 256, 4096, 14336) == default(t, 128, 4096, 4096) == (64, 128, 128, 4)
        assert default(t, 256, 6144, 4096)[0] == default(t, 512, 4096, 4096)[0] == 128
    if op != "gemm_fp8":  # (the A100 has no e4m3)
        assert default("a100", 256, 4096, 14336)[0] == 128


def test_contraction_defaults_valid():
    """Every op's default is in its space, for the Llama shapes and for a tiny model's (K=128, whose
    one-row GEMV tile needs fewer warps, not a shallower k step); a fused norm's 256-row int4 tile,
    too big for shared memory with the norm's weight, halves its rows; from 2048 rows a quantized
    weight is dequantized first, under the dense op's tile."""
    for t in ("h200", "a100", "mi300x", "mi250"):
        for m in (1, 16, 33, 256, 1024, 4096):
            for op, kw in CASES + [("gemm_fp8", {}), ("rmsnorm_gemm", {}), ("rmsnorm_gemm_w4a16", dict(G=128))]:
                for n, k in ((6144, 4096), (256, 128)):
                    group = {"G": k} if kw.get("group") == "channel" else {"G": min(kw["G"], k)} if "G" in kw else {}
                    wl = flashgen.workload(op, M=m, N=n, K=k, **{**kw, **group})
                    space = ScheduleSpace(wl, get_target(t))
                    assert space.why_invalid(space.default()) is None, (wl, t)
    tiny = ScheduleSpace(flashgen.workload("gemm", M=1, N=256, K=128, dtype="bf16"), get_target("h200")).default()
    assert (tiny["block_k"], tiny["num_warps"], tiny["num_stages"]) == (128, 2, 3), tiny
    big_space = ScheduleSpace(flashgen.workload("rmsnorm_gemm_w4a16", M=1024, N=6144, K=4096, G=128), get_target("h200"))
    big = big_space.flat(big_space.default())
    assert (big["block_m"], big["block_n"], big["num_warps"], big["dequant_first"]) == (128, 128, 8, 0), big
    for op in ("gemm_w4a16", "rmsnorm_gemm_w4a16", "gemm_w8a16", "gemm_w4a8"):
        wl = flashgen.workload(op, M=4096, N=6144, K=4096, **({"G": 128} if "w4" in op else {}))
        dense_op = "gemm_w8a8" if op == "gemm_w4a8" else op.replace("_w4a16", "").replace("_w8a16", "")
        dense = ScheduleSpace(flashgen.workload(dense_op, M=4096, N=6144, K=4096), get_target("h200")).default()
        assert ScheduleSpace(wl, get_target("h200")).default() == {**dense, "variant": "dq_" + dense["variant"],
                                                                    "dequant_chunks": 2}, op


def test_shared_memory_rule_counts_what_prologues_load():
    """Per tile element, A loads 2 bytes; B half a byte of packed word, plus a group's scale once per
    group when the k tile spans several groups (G=128: a tile of 256 k reads two scales per column)."""
    from flashgen.schedules.contraction_space import load_bytes
    wl = flashgen.workload("gemm_w4a16", M=1, N=8192, K=8192, G=128, dtype="fp16")
    assert load_bytes(wl, 128) == (2, 0.5)
    assert load_bytes(wl, 256) == (2, 0.5 + 2 / 128)
    # gemm_w4a8's `lanes` codes: half a byte, and an int8 group scale per 128 k (none per channel)
    lanes = flashgen.workload("gemm_w4a8", M=256, N=8192, K=8192, G=128, dtype="bf16", pack="lanes")
    assert load_bytes(lanes, 128) == (1, 0.5 + 1 / 128)
    per_channel = flashgen.workload("gemm_w4a8", M=256, N=8192, K=8192, G=8192, dtype="bf16", pack="lanes", group="channel")
    assert load_bytes(per_channel, 128) == (1, 0.5)
    space = ScheduleSpace(flashgen.workload("gemm_w4a16", M=256, N=8192, K=8192, G=128, dtype="fp16"),
                          get_target("h200"))
    bad = {"block_m": 256, "block_n": 256, "block_k": 512, "num_warps": 8, "num_stages": 5, "group_m": 1}
    assert "shared memory" in space.why_invalid(bad)
    assert space.is_valid(space.default())


def test_int4_matrix_tiles_unpack_in_the_operand_layout():
    """A W4A16 matrix tile computes W x^T: code j of 16 words is a run of 16 k, made a 16-bit float by
    an AND-OR with the exponent; the runs of one group (G=64: four) are joined into one operand tile,
    one dot per group, the scale applied once per group, no reshape of loaded data through shared
    memory. On sm_90 the weight is wgmma's register operand: shared memory holds packed words, and no
    dequantized tile is stored to it 2 bytes at a time."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import opcodes, summary
    wl = flashgen.workload("gemm_w4a16", M=16, N=256, K=512, G=64, dtype="bf16")
    s = {"block_m": 16, "block_n": 64, "block_k": 256, "num_warps": 4, "num_stages": 3, "group_m": 1}
    binary = flashgen.compile(wl, "sm_90", schedule=s).binary
    sass = summary(opcodes(binary))
    assert sass["wgmma"] > 0 and sass["sts_16bit"] <= 2, sass
    assert_budget("int4_mma", binary)


def test_int4_ptx_unpack():
    """ptx_unpack: two codes per AND-OR in inline PTX, on NVIDIA int4 matrix tiles only; fewer
    instructions than the Triton expressions, still no 2-byte shared stores. (Triton's interpreter runs
    no PTX: its numerics are checked on the GPU.)"""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import loop_opcodes, opcodes, summary
    wl = flashgen.workload("gemm_w4a16", M=16, N=256, K=4096, G=128, dtype="bf16")
    assert ScheduleSpace(wl, get_target("h200")).values("ptx_unpack") == (0, 1, 2)  # 2: GEMV tiles only
    assert ScheduleSpace(wl.with_dims(M=17), get_target("h200")).values("ptx_unpack") == (0, 1)
    assert ScheduleSpace(wl, get_target("mi300x")).values("ptx_unpack") == (0,)
    assert ScheduleSpace(flashgen.workload("gemm", M=16, N=256, K=512), get_target("h200")).values("ptx_unpack") == (0,)
    s = {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3, "group_m": 1}
    gemv = ScheduleSpace(wl.with_dims(M=1), get_target("h200"))
    assert gemv.is_valid({**s, "block_m": 1, "block_n": 16, "block_k": 1024, "ptx_unpack": 1})
    g64 = ScheduleSpace(flashgen.workload("gemm_w4a16", M=1, N=256, K=4096, G=64, dtype="bf16"), get_target("h200"))
    assert "groups must span 128" in g64.why_invalid({**s, "block_m": 1, "block_n": 16, "block_k": 1024, "ptx_unpack": 1})
    assert "GEMV tiles" in ScheduleSpace(wl, get_target("h200")).why_invalid({**s, "ptx_unpack": 2})
    assert "fma.rn.bf16x2" in flashgen.compile(wl, "sm_90", schedule={**s, "ptx_unpack": 1}).asm["ptx"]
    counts = {}
    for target in ("sm_90", "sm_80"):
        for u in (0, 1):
            binary = flashgen.compile(wl, target, schedule={**s, "ptx_unpack": u}).binary
            assert summary(opcodes(binary))["sts_16bit"] == 0
            loop = loop_opcodes(binary)  # the k loop: one step of 128 x 64 codes
            assert any(op.startswith(("HGMMA", "HMMA")) for op in loop), (target, u, loop)
            counts[target, u] = sum(loop.values())
        assert counts[target, 1] < 0.85 * counts[target, 0], counts


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_int4_gemv_pairs(dtype):
    """ptx_unpack in GEMV tiles: one inline-PTX dot per word and row in fp16 pairs (x in fp16, scaled
    by 2^-8 when it is bf16), fewer instructions per k step than the fp32 codes on sm_90 and sm_80.
    (Numerics: on the GPU.)"""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import loop_opcodes
    wl = flashgen.workload("gemm_w4a16", M=2, N=512, K=4096, G=128, dtype=dtype, zp="asym")
    s = {"block_m": 2, "block_n": 16, "block_k": 1024, "num_warps": 4, "num_stages": 3, "group_m": 1, "ptx_unpack": 1}
    for target in ("sm_90", "sm_80"):
        binaries = [flashgen.compile(wl, target, schedule={**s, "ptx_unpack": u}).binary for u in (0, 1)]
        loops = [sum(loop_opcodes(b).values()) for b in binaries]
        assert loops[1] < 0.9 * loops[0], (target, loops)
        if target == "sm_90":
            assert_budget(f"int4_gemv_pairs_{dtype}", binaries[1])


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_int4_gemv_quads(dtype):
    """ptx_unpack=2 in GEMV tiles: the words and x pairs split into quads of consecutive words, one
    inline-PTX dot per quad and row (one conversion to fp32 and one scale per four words): fewer k-loop
    instructions than one dot per word, on sm_90 and sm_80. (Numerics: on the GPU.)"""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import loop_opcodes
    wl = flashgen.workload("gemm_w4a16", M=2, N=512, K=4096, G=128, dtype=dtype, zp="asym")
    s = {"block_m": 2, "block_n": 16, "block_k": 1024, "num_warps": 2, "num_stages": 3, "group_m": 1, "ptx_unpack": 2}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s)
    assert_budget(f"int4_gemv_quads_{dtype}", flashgen.compile(wl, "sm_90", schedule=s).binary)
    for target in ("sm_90", "sm_80"):
        loops = [sum(loop_opcodes(flashgen.compile(wl, target, schedule={**s, "ptx_unpack": u}).binary).values())
                 for u in (1, 2)]
        assert loops[1] < 0.93 * loops[0], (target, loops)


def test_bf16_x_pairs_packed_by_one_conversion():
    """bf16 x, scaled into fp16 through fp32 anyway, is packed two at a time by one paired conversion
    (F2FP in the SASS); fp16 x keeps its integer pairing. The bf16 one-stage quad tile's k loop gets
    shorter than fp32 halves paired with integer ops would make it (634 against 667 when measured)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import loop_opcodes
    s = {"block_m": 1, "block_n": 16, "block_k": 2048, "num_warps": 4, "num_stages": 1, "group_m": 1, "ptx_unpack": 2}
    loops = {}
    for dt in ("bf16", "fp16"):
        wl = flashgen.workload("gemm_w4a16", M=1, N=4096, K=4096, G=128, dtype=dt)
        assert ("cvt.rn.f16x2.f32" in generate(wl, s).source) == (dt == "bf16")
        k = flashgen.compile(wl, "sm_90", schedule=s)
        assert ("F2FP" in "".join(loop_opcodes(k.binary))) == (dt == "bf16"), dt
        loops[dt] = sum(loop_opcodes(k.binary).values())
    assert loops["bf16"] < 650, loops


@pytest.mark.parametrize("block_m", [2, 16])
def test_int4_groups_not_dividing_the_k_tile(interpreter, block_m):
    """G=48 (a multiple of 16 that does not divide a 128-deep k tile): the codes sharing a scale are
    counted from group boundaries, not from each tile's start; ALU and matrix tiles."""
    wl = flashgen.workload("gemm_w4a16", M=5, N=40, K=384, G=48, dtype="fp16", zp="asym")
    s = {"block_m": block_m, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 2, "group_m": 1}
    for c in interpreter.check(wl, s, "h200", seed=16):
        assert c.ok, c


def test_int4_generic_prologue_unpacks_tiles():
    """A group size that is no multiple of 16 leaves the fused path: the tile's words are loaded once,
    unpacked by a reshape in k order, and each group's scale row is loaded per k (K=200 also pads)."""
    wl = flashgen.workload("gemm_w4a16", M=16, N=256, K=200, G=40, dtype="fp16")
    src = generate(wl, {"block_m": 16, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 2,
                        "group_m": 1}).source
    assert "tl.reshape(words_w_packed, [BLOCK_K // 128, 1, 16, BLOCK_N])" in src and "tl.trans(" not in src


def test_int4_generic_prologue_numerics(interpreter):
    wl = flashgen.workload("gemm_w4a16", M=5, N=40, K=200, G=40, dtype="fp16", zp="asym")
    for bm in (2, 16):
        s = {"block_m": bm, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 2, "group_m": 1}
        for c in interpreter.check(wl, s, "h200", seed=bm):
            assert c.ok, c


EPILOGUES = [("gemm", dict(with_bias="yes", act="silu", with_residual="yes")), ("gemm_w8a16", dict(act="gelu")),
             ("gemm_w8a8", dict(with_bias="yes", out="int8")), ("gemm_w4a16", dict(G=64, with_residual="yes", zp="asym")),
             ("gemm", dict(act="gelu", out="int8"))]


@pytest.mark.parametrize("op, kw", EPILOGUES, ids=[f"{o}-{'-'.join(map(str, kw.values()))}" for o, kw in EPILOGUES])
def test_fused_epilogues(interpreter, op, kw):
    """Bias, activation, residual and int8 output quantization, written as IR expressions, fused."""
    wl = flashgen.workload(op, M=5, N=48, K=128, dtype="fp16", **kw)
    names = {t.name for t in wl.inputs + wl.outputs}
    assert ("bias" in names) == (kw.get("with_bias") == "yes") and ("y_q" in names) == (kw.get("out") == "int8")
    s = {"block_m": 16, "block_n": 32, "block_k": 128 if op == "gemm_w4a16" else 64, "num_warps": 4,
         "num_stages": 2, "group_m": 1}
    checks = interpreter.check(wl, s, "h200", seed=4)
    assert {c.tensor for c in checks} == {t.name for t in wl.outputs}
    for c in checks:
        assert c.ok, c
    k = flashgen.compile(wl, "sm_90")
    assert k.binary[:4] == b"\x7fELF"


FUSED = [("rmsnorm_gemm", {}, 3, 200, dict(block_m=1, block_n=16, block_k=128, num_warps=2, num_stages=2, early_load=1)),
         ("rmsnorm_gemm", {"with_residual": "yes"}, 5, 200, dict(block_m=2, block_n=32, block_k=64, num_warps=2,
                                                              num_stages=2, split_k=2)),
         ("rmsnorm_gemm", {}, 17, 200, dict(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)),
         ("rmsnorm_gemm_w4a16", {"G": 128}, 3, 384, dict(block_m=2, block_n=16, block_k=128, num_warps=2, num_stages=2)),
         ("rmsnorm_gemm_w4a16", {"G": 64, "zp": "asym"}, 17, 384, dict(block_m=16, block_n=32, block_k=128, num_warps=4,
                                                                        num_stages=2)),
         ("silu_mul_gemm", {"with_residual": "yes"}, 3, 200, dict(block_m=1, block_n=16, block_k=128, num_warps=2,
                                                                   num_stages=2, early_load=1)),
         ("silu_mul_gemm_w8a16", {}, 17, 200, dict(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)),
         ("silu_mul_gemm_w4a16", {"G": 128}, 3, 384, dict(block_m=2, block_n=16, block_k=128, num_warps=2, num_stages=2))]


@pytest.mark.parametrize("op, kw, m, k, s", FUSED, ids=[f"{o}-m{m}-bm{s['block_m']}" for o, _, m, _, s in FUSED])
def test_fused_prologue_numerics(interpreter, op, kw, m, k, s):
    """A norm or SiLU·mul fused into the GEMM it feeds: unsplit GEMV tiles sum the norm's squares in the
    k loop, split ones and matrix tiles (the transposed int4 tile too) in a row pass before it; fp16,
    K=200 and 384 leave partial k steps, M=3, 5 and 17 partial row tiles, N=40 a partial column tile."""
    wl = flashgen.workload(op, M=m, N=40, K=k, dtype="fp16", **kw)
    s = {"group_m": 1, **s}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s), ScheduleSpace(wl, get_target("h200")).why_invalid(s)
    for c in interpreter.check(wl, s, "h200", seed=m):
        assert c.ok, c


def test_fused_norm_sums_squares_where_the_tile_loads_x():
    """Where the squares are summed: in an unsplit GEMV tile's k loop (the inverse root scales each row's
    sum after it, and x enters the int4 tiles' fp16 pairs scaled by 2^-8, as it is not normalized),
    else in a row pass over K before the loop."""
    from flashgen.ir import expr as E
    from flashgen.targets.triton.contraction import row_factors
    x, inv, nw = E.Load("x", (E.Index("r"), E.Index("k"))), E.Ref("inv"), E.Load("norm_w", (E.Index("k"),))
    assert row_factors(x * inv * nw, {"inv"}) == (x * nw, (inv,))
    assert row_factors(x + inv, {"inv"}) == (x + inv, ())
    wl = flashgen.workload("rmsnorm_gemm_w4a16", M=1, N=256, K=1024, G=128, dtype="fp16")
    gemv = {"block_m": 1, "block_n": 16, "block_k": 512, "num_warps": 4, "num_stages": 3, "group_m": 1, "ptx_unpack": 2}
    src = generate(wl, gemv).source
    assert "ss_part_r0 +=" in src and "for kp0" not in src and "* inv_r0)[None, :]" in src and "* 0.00390625)" in src
    assert "cvt.rn.f16x2.f32" in src  # x without its norm's root, scaled into fp16 pairs
    split = generate(wl, {**gemv, "ptx_unpack": 0, "split_k": 2}).source
    assert "for kp0 in range(0, K, 1024)" in split and "ss_part" not in split
    matrix = generate(wl.with_dims(M=16), {**gemv, "block_m": 16, "block_k": 128, "ptx_unpack": 1}).source
    assert "r_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]" in matrix


def test_search_proposes_valid_gemm_schedules():
    """The search and the analytic prior work on the contraction space as on the row classes."""
    from flashgen.db.record import schedule_key
    from flashgen.schedules.cost_model import AnalyticPrior
    from flashgen.schedules.search import make_strategy
    wl = flashgen.workload("gemm_w8a8", M=256, N=8192, K=8192)
    space = ScheduleSpace(wl, get_target("h200"))
    strat = make_strategy("evolutionary", space, AnalyticPrior(), seed=0)
    first = strat.propose(8)
    strat.observe([(s, 100.0 + i) for i, s in enumerate(first)])
    second = strat.propose(8)
    keys = [schedule_key(s) for s in first + second]
    assert len(keys) == len(set(keys)) == 16
    assert all(space.is_valid(s) for s in first + second)
    assert all(s["block_m"] >= 64 for s in first[:3])  # the prior knows a 256-row GEMM wants big tiles


@pytest.mark.parametrize("zp", ["sym", "asym"])
def test_k_tiles_spanning_several_groups(interpreter, zp):
    """block_k = 4 groups of 32, with a K tail (224 = 128 + 96): scale and zero-point rows loaded once
    per group and repeated over it."""
    wl = flashgen.workload("gemm_w4a16", M=3, N=40, K=224, G=32, dtype="fp16", zp=zp)
    s = {"block_m": 16, "block_n": 32, "block_k": 128, "num_warps": 4, "num_stages": 2, "group_m": 1}
    for c in interpreter.check(wl, s, "h200", seed=7):
        assert c.ok, c


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_int4_operand_scale(dtype):
    """operand_scale: PTX-unpacked int4 matrix tiles multiply each code pair by its row's group scale
    in the 16-bit float, so every group accumulates into one tile: no FFMA with a scale in the k loop,
    one accumulator (128 x 256 tiles fit), symmetric codes in groups of 128 k or more only, NVIDIA only.
    (Numerics: on the GPU.)"""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import loop_opcodes, opcodes, summary
    wl = flashgen.workload("gemm_w4a16", M=256, N=512, K=4096, G=128, dtype=dtype)
    h200 = ScheduleSpace(wl, get_target("h200"))
    assert h200.values("operand_scale") == (0, 1)
    assert ScheduleSpace(wl, get_target("mi300x")).values("operand_scale") == (0,)
    for kw in ({"G": 128, "zp": "asym"}, {"G": 64}):
        other = flashgen.workload("gemm_w4a16", M=256, N=512, K=4096, dtype=dtype, **kw)
        assert ScheduleSpace(other, get_target("h200")).values("operand_scale") == (0,)
    s = {"block_m": 128, "block_n": 256, "block_k": 128, "num_warps": 8, "num_stages": 3, "group_m": 8,
         "ptx_unpack": 1, "operand_scale": 1}
    assert h200.is_valid(s) and "accumulator" in h200.why_invalid({**s, "operand_scale": 0})
    assert "PTX-unpacked" in h200.why_invalid({**s, "ptx_unpack": 0})
    small = {**s, "block_m": 16, "block_n": 64, "num_warps": 4}
    loop = loop_opcodes(flashgen.compile(wl.with_dims(M=16), "sm_90", schedule=small).binary)
    assert any(op.startswith("HGMMA") for op in loop) and "FFMA" not in loop, loop
    assert_budget("int4_mma_operand_scale", flashgen.compile(wl.with_dims(M=16), "sm_90", schedule=small).binary)
    assert summary(opcodes(flashgen.compile(wl.with_dims(M=16), "sm_90", schedule=small).binary))["sts_16bit"] == 0


def test_default_quality_replay(tmp_path, monkeypatch):
    """benchmarks/studies/default_quality.py scores a workload's recorded default against its best record and
    counts, without scoring, a workload whose default has no record; failed records are ignored."""
    import json
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    import default_quality
    from flashgen.db import Record
    h200 = get_target("h200")
    scored = flashgen.workload("gemm", M=1, N=4096, K=4096, dtype="bf16")
    unscored = flashgen.workload("gemm", M=1, N=6144, K=4096, dtype="bf16")
    default = ScheduleSpace(scored, h200).default()
    other = {**default, "block_k": 1024}
    assert ScheduleSpace(scored, h200).is_valid(other) and other != default

    def record(wl, schedule, latency, status="ok"):
        return Record(workload_key=wl.key, workload=wl.to_json(), target_key=h200.id, schedule=schedule,
                      status=status, latency_us=latency, spread_us=None if latency is None else 0.1,
                      device="NVIDIA H200").to_json()

    rows = [record(scored, default, 20.0), record(scored, default, 16.0), record(scored, other, 10.0),
            record(scored, {**other, "block_k": 2048}, None, "crash"), record(unscored, other, 9.0)]
    log = tmp_path / "records.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(sys, "argv", ["default_quality.py", str(log), "--out-dir", str(tmp_path), "--name", "dq"])
    default_quality.main()
    out = json.loads((tmp_path / "dq.json").read_text())
    assert out["rows"] == [["gemm", "bf16", "M=1 N=4096 K=4096", 16.0, 10.0, 0.625]]
    assert "1 more have records but none of their default" in (tmp_path / "dq.md").read_text()


DEQUANT = [("dequant_w4a16", dict(N=40, K=320, G=64, zp="asym")), ("dequant_w4a16", dict(N=33, K=256, G=256, group="channel")),
           ("dequant_w4a16", dict(N=7, K=200, G=40)), ("dequant_w8a16", dict(N=37, K=200))]


@pytest.mark.parametrize("op, kw", DEQUANT, ids=[f"{o}-{'-'.join(map(str, kw.values()))}" for o, kw in DEQUANT])
def test_dequant_ops_numerics(interpreter, op, kw):
    """The weight prologues as pointwise ops: int4 codes less their zero point times their group or
    channel scale (K=200 and 320 pad the last packed block), int8 codes times the channel scale; odd
    N leaves a partial row tile."""
    wl = flashgen.workload(op, dtype="fp16" if "zp" in kw else "bf16", **kw)
    space = ScheduleSpace(wl, get_target("h200"))
    for s in (space.default(), {"block_r": 4, "block_c": 64, "num_warps": 2}):
        assert space.is_valid(s), space.why_invalid(s)
        for c in interpreter.check(wl, s, "h200", seed=5):
            assert c.ok, c


STAGED = [("gemm_w4a16", dict(G=64, zp="asym"), 40, 320, 1, 1), ("gemm_w4a16", dict(G=320, group="channel", with_bias="yes"), 40, 320, 1, 1),
          ("gemm_w8a16", dict(with_residual="yes"), 40, 200, 0, 1), ("rmsnorm_gemm_w4a16", dict(G=128), 40, 256, 0, 1),
          ("gemm_w4a16", dict(G=32, zp="asym", with_bias="yes", with_residual="yes"), 128, 320, 1, 4),
          ("gemm_w8a16", dict(out="int8"), 128, 200, 0, 2), ("rmsnorm_gemm_w4a16", dict(G=128), 96, 256, 0, 2),
          ("gemm_w4a16", dict(G=128), 128, 256, 1, 8),
          # w4a8's int8 operand written first, then gemm_w8a8's tiles (TMA where K allows) with the channel scale
          ("gemm_w4a8", dict(G=64), 40, 320, 1, 1), ("gemm_w4a8", dict(G=256, group="channel", with_bias="yes"), 128, 256, 1, 4)]


@pytest.mark.parametrize("op, kw, n, k, tma, chunks", STAGED,
                         ids=[f"{o}-{'-'.join(map(str, kw.values()))}-c{c}" for o, kw, _, _, _, c in STAGED])
def test_dequant_first_numerics(interpreter, op, kw, n, k, tma, chunks):
    """dequant_first: the weight dequantized by its own kernel into a scratch buffer, then the dense
    op's tiles (TMA copies where the operands allow; a fused norm runs in the dense op) on it, whole
    or in chunks of its rows (each with its slice of the bias, residual and output). M=515, N=40 and
    K=200 / 320 leave partial tiles on every side; two seeds reuse the scratch weight."""
    wl = flashgen.workload(op, M=515, N=n, K=k, dtype="fp16", **kw)
    s = {"block_m": 64, "block_n": 32 if chunks == 1 else 16, "block_k": 64, "num_warps": 4, "num_stages": 2,
         "group_m": 8, "dequant_first": 1, "tma": tma, "dequant_chunks": chunks}
    assert ScheduleSpace(wl, get_target("h200")).is_valid(s), ScheduleSpace(wl, get_target("h200")).why_invalid(s)
    for seed in (8, 9):
        for c in interpreter.check(wl, s, "h200", seed=seed):
            assert c.ok, c


def test_dequant_first_rules_and_build(tmp_path):
    """The knob is offered to ops with a weight prologue from DEQUANT_FIRST_MIN_M rows, with the dense
    op's knobs (16-bit k steps, TMA) and rules, never with code unpacking; from 2048 rows it is the
    default. The sm_90 binary of the GEMM is warpgroup MMA on TMA copies; the kernel saves both parts."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "studies"))
    from disasm import opcodes, summary
    from flashgen.schedules.contraction_space import DEQUANT_FIRST_MIN_M
    h200 = get_target("h200")
    wl = flashgen.workload("gemm_w4a16", M=4096, N=512, K=1024, G=128, dtype="bf16")
    space = ScheduleSpace(wl, h200)
    assert space.values("dequant_first") == (0, 1) and 64 in space.knobs()["block_k"] and space.values("tma") == (0, 1)
    assert ScheduleSpace(wl.with_dims(M=DEQUANT_FIRST_MIN_M - 1), h200).values("dequant_first") == (0,)
    for op in ("gemm", "gemm_w8a8", "gemm_fp8"):
        assert ScheduleSpace(flashgen.workload(op, M=4096, N=512, K=1024), h200).values("dequant_first") == (0,)
    s = {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3, "group_m": 8, "tma": 1,
         "dequant_first": 1}
    assert space.is_valid(s)
    assert "no codes to unpack" in space.why_invalid({**s, "ptx_unpack": 1})
    assert "TMA" in space.why_invalid({**s, "dequant_first": 0, "block_k": 128})
    assert "int4 words" in space.why_invalid({**s, "dequant_first": 0, "tma": 0})
    assert space.flat(space.default())["dequant_first"] == 1
    smaller = ScheduleSpace(wl.with_dims(M=1024), h200)
    assert smaller.flat(smaller.default())["dequant_first"] == 0
    assert space.values("dequant_chunks") == (1, 2, 4, 8)
    assert "need dequant_first" in space.why_invalid({**s, "dequant_first": 0, "dequant_chunks": 2})
    assert space.is_valid({**s, "dequant_chunks": 4})
    assert "chunks of a multiple of 16" in ScheduleSpace(wl.with_dims(N=480), h200).why_invalid({**s, "dequant_chunks": 4})
    # chunks by default while each chunk's GEMM keeps about two waves of 128 x 256 tiles on 132 SMs
    for (n, k), chunks in {(8192, 8192): 4, (6144, 4096): 2, (4096, 4096): 2, (28672, 4096): 4}.items():
        llama = flashgen.workload("gemm_w4a16", M=4096, N=n, K=k, G=128, dtype="fp16")
        assert ScheduleSpace(llama, h200).default()["dequant_chunks"] == chunks, (n, k)
    k = flashgen.compile(wl, "sm_90", schedule=s)
    assert [p.workload.op_name for p in k.parts] == ["dequant_w4a16", "gemm"]
    sass = summary(opcodes(k.binary))
    assert sass["wgmma"] > 0 and sass["tma"] > 0, sass
    names = {p.name for p in k.save(tmp_path)}
    assert {"dequant_w4a16_kernel.cubin", "gemm_kernel.cubin", "gemm_w4a16_staged.json"} <= names
    amd = flashgen.compile(wl, "gfx942", schedule={**s, "tma": 0, "block_n": 128, "num_stages": 2})
    assert [p.binary_kind for p in amd.parts] == ["hsaco", "hsaco"]


def test_word_unpacking_pointwise_default():
    """A pointwise op that shifts codes out of loaded words gets 64 columns a thread (2048 a program,
    one warp), so each thread loads its words once for four codes; other pointwise ops keep 8."""
    h200 = get_target("h200")
    w4 = ScheduleSpace(flashgen.workload("dequant_w4a16", N=8192, K=4096, G=128), h200).default()
    assert w4 == {"block_r": 1, "block_c": 2048, "num_warps": 1}
    w8 = ScheduleSpace(flashgen.workload("dequant_w8a16", N=8192, K=4096), h200).default()
    assert w8["block_c"] * w8["block_r"] // (w8["num_warps"] * 32) == 8
