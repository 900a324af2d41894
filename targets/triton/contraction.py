"""Triton code generation for the contraction class: GEMMs with fused prologues and epilogues.

One program computes a block_m x block_n tile of the output. Tiles are numbered along one grid axis
and grouped `group_m` row-tiles at a time, so that programs running together share weight tiles in
the L2. For tiles of 16 rows or more, the k loop loads an A tile [block_m, block_k] and a B tile
[block_k, block_n] through the op's prologue expressions (unpacking, dequantization), casts both to
the operand dtype and accumulates `tl.dot` in fp32 (or int32 for int8 operands); Triton pipelines the
loop over `num_stages` buffers. Tiles of fewer rows are GEMVs on the ALUs (`_gemv`). With `split_k`,
a third grid axis shares each tile's k range, and the last split to finish merges (`_merge_splits`).
With `persistent`, a fixed number of programs per SM walk the tiles in turn. With `tma` (sm_90,
operands without a prologue), TMA descriptors copy the A and W tiles. The epilogue (scales,
stores) runs on the accumulator tile. Statements before the Contract (a fused norm's sum of squares
and inverse root) are a row pass: matrix tiles run it over K before their k loop, unsplit GEMV tiles
fold it into theirs.
"""
from __future__ import annotations

import math
from dataclasses import replace

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir.op import Contract, Let, Reduce, Stmt, Store, eval_int
from flashgen.schedules.contraction_space import MMA_MIN_ROWS, int4_affine, operand_dtype, tma_operands
from flashgen.schedules.space import Schedule
from flashgen.ir import prologue
from flashgen.quant import INT4_PERIOD
from flashgen.targets.triton.emit import (Emitter, KernelSource, Scope, Scratch, grid_dependency, kernel_args,
                                          module_header)
from flashgen.workload import Workload

ACC = {"fp32": "tl.float32", "int32": "tl.int32"}
MAGIC = 8388608.0  # 2^23: an fp32 with 2^23's exponent holds a small integer in its low mantissa bits
# A 16-bit float's bits, and its value, whose low mantissa bits hold a 4-bit code exactly.
INT4_MAGIC = {"bf16": (0x4300, 128.0), "fp16": (0x6400, 1024.0)}
# Per 16-bit float: the PTX type, 1.0 and -(magic + 8) as a pair of 16-bit values.
PAIR = {"bf16": ("bf16x2", 0x3F803F80, 0xC308C308), "fp16": ("f16x2", 0x3C003C00, 0xE408E408)}
RUN = prologue.RUN


def _ptx_codes(operand: str, j: int, scaled: bool = False) -> str:
    """Inline PTX for code j - 8 of two words at once (`pack=2`: the two 16-bit results share a
    register): PRMT gathers the half-words holding code j of both words, a shift and one LOP3 put each
    code under the 16-bit float's exponent, one paired FMA subtracts magic + 8. `scaled`
    (`operand_scale`): the pair is then multiplied by the rows' group scale in the same 16-bit float
    ($3: the two words' scales, one 16-bit pair, as both words lie in one row), so that the matrix
    instruction accumulates every group into one tile."""
    kind, one, minus = PAIR[operand]
    magic = INT4_MAGIC[operand][0]
    shift = f"shr.b32 t, t, {4 * (j % 4)}; " if j % 4 else ""
    scale = ""
    if scaled:  # bf16x2 has no mul before sm_90: an FMA adding -0
        scale = (" mul.rn.f16x2 $0, t, $3;" if operand == "fp16"
                 else " mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, $3, z;")
    return (f"{{ .reg .b32 {'z, ' if scaled else ''}t, one, minus; "
            f"prmt.b32 t, $1, $2, {0x5410 if j < 4 else 0x7632:#x}; {shift}"
            f"lop3.b32 t, t, 0x000F000F, {magic << 16 | magic:#x}, 0xEA; "
            f"mov.b32 one, {one:#x}; mov.b32 minus, {minus:#x}; fma.rn.{kind} {'t' if scaled else '$0'}, t, one, minus;"
            f"{scale} }}")


# fp16 pairs: 1.0, -(1024 + 8), 1/16 and -(64 + 8). A code under 0x6400 reads 1024 + code (or, four bits
# up, 1024 + 16 * code).
F16 = {"one": 0x3C003C00, "m1032": 0xE408E408, "sixteenth": 0x2C002C00, "m72": 0xD480D480}
# x in fp16 is x * 2^-X16_SHIFT for bf16 activations, so that fp16's range covers bf16 values up to 2^24.
X16_SHIFT = 8


def _ptx_word_dot() -> str:
    """Inline PTX for the dot of one word's eight int4 codes (minus 8) with eight x values, in fp16 pairs
    (`_int4_pair_terms`): each AND-OR puts codes j and j + 4 (bits 4j and 4j + 16) under fp16 exponents,
    one paired FMA subtracts 8, one paired FMA multiplies by (x_j, x_j+4) and adds; the pair's halves
    are summed in fp32. Four codes per lane are summed in fp16: a product rounds to 11 bits, as a
    16-bit dot product's would."""
    c = F16
    lines = [".reg .b32 w, t, acc, one, m1032, sixteenth, m72;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi;",
             f"mov.b32 one, {c['one']:#x};", f"mov.b32 m1032, {c['m1032']:#x};",
             f"mov.b32 sixteenth, {c['sixteenth']:#x};", f"mov.b32 m72, {c['m72']:#x};"]
    for q in range(4):
        src = "$1" if q < 2 else "w"
        if q == 2:
            lines.append("shr.b32 w, $1, 8;")
        if q % 2 == 0:  # codes q, q + 4 in bits 0-3 of each half
            lines.append(f"lop3.b32 t, {src}, 0x000F000F, 0x64006400, 0xEA;")
            lines.append("fma.rn.f16x2 t, t, one, m1032;")
        else:  # codes in bits 4-7 of each half: 1024 + 16 * code
            lines.append(f"lop3.b32 t, {src}, 0x00F000F0, 0x64006400, 0xEA;")
            lines.append("fma.rn.f16x2 t, t, sixteenth, m72;")
        lines.append("mul.rn.f16x2 acc, t, $2;" if q == 0 else f"fma.rn.f16x2 acc, t, ${q + 2}, acc;")
    lines += ["mov.b32 {lo, hi}, acc;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.f32 flo, flo, fhi;",
              "mov.b32 $0, flo;"]
    return "{ " + " ".join(lines) + " }"


def _ptx_quad_dot() -> str:
    """Inline PTX for the dot of four words' codes (minus 8) with their x values, as `_ptx_word_dot`
    does one word's, all sixteen paired products summed in one fp16 pair before the two halves are
    converted and added in fp32: one conversion and one scale per four words instead of per word.
    $1-$4 are the words, $(5 + 4 i + q) word i's x pair q."""
    c = F16
    lines = [".reg .b32 w, t, acc, one, m1032, sixteenth, m72;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi;",
             f"mov.b32 one, {c['one']:#x};", f"mov.b32 m1032, {c['m1032']:#x};",
             f"mov.b32 sixteenth, {c['sixteenth']:#x};", f"mov.b32 m72, {c['m72']:#x};"]
    for i in range(4):
        for q in range(4):
            src = f"${1 + i}" if q < 2 else "w"
            if q == 2:
                lines.append(f"shr.b32 w, ${1 + i}, 8;")
            if q % 2 == 0:
                lines.append(f"lop3.b32 t, {src}, 0x000F000F, 0x64006400, 0xEA;")
                lines.append("fma.rn.f16x2 t, t, one, m1032;")
            else:
                lines.append(f"lop3.b32 t, {src}, 0x00F000F0, 0x64006400, 0xEA;")
                lines.append("fma.rn.f16x2 t, t, sixteenth, m72;")
            x = f"${5 + 4 * i + q}"
            lines.append(f"mul.rn.f16x2 acc, t, {x};" if i == q == 0 else f"fma.rn.f16x2 acc, t, {x}, acc;")
    lines += ["mov.b32 {lo, hi}, acc;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.f32 flo, flo, fhi;",
              "mov.b32 $0, flo;"]
    return "{ " + " ".join(lines) + " }"


ROW_PASS_ELEMENTS = 4096  # x elements a row pass loads per step: [rows, k] tiles of at most this many


def _row_pass(em: Emitter, con: Contract, scope: Scope, rows: str, k_axis: int | None, step: int,
              suffix: str = "", summed: bool = False) -> None:
    """The row pass (the statements before the Contract: sums along k and values of them) over all of
    K, after the wait for the previous kernel and before the k loop, `step` k at a time; or, `summed`,
    after a GEMV tile's k loop, which accumulated each sum's partial tile (`_sum_in_loop`). `rows` is
    the row index: a scalar (`k_axis` None, a GEMV tile's row), [block_m, 1] (`k_axis` 1) or
    [1, block_m] (`k_axis` 0, the transposed int4 matrix tile). Each value is named `name + suffix`,
    and em.named maps the statement's name to it (a GEMV tile rebinds the names per row, `_bind_row`)."""
    k_extent = em.emit(con.extent, scope)
    if not summed:
        scope.line(f"rmask_p{suffix} = {rows} < {em.emit(em.op.domain[0], scope)}")
    for st in em.row_pass:
        name = f"{st.name}{suffix}"
        if isinstance(st, Let):
            scope.line(f"{name} = {em.emit(st.value, scope.child(fresh=True))}")
        elif summed:
            scope.line(f"{name} = tl.sum({st.name}_part{suffix})")
        else:
            assert isinstance(st, Reduce) and st.kind == "sum", st
            shape = "[]" if k_axis is None else "[BLOCK_M, 1]" if k_axis == 1 else "[1, BLOCK_M]"
            scope.line(f"{name} = tl.zeros({shape}, dtype=tl.float32)")
            scope.line(f"for kp0 in range(0, {k_extent}, {step}):")
            inner = scope.child(scope.indent + "    ", {"r": (rows, f"rmask_p{suffix}"), "k": ("kp", "kpmask")}, fresh=True)
            inner.line(f"kp = kp0 + tl.arange(0, {step}){ {None: '', 0: '[:, None]', 1: '[None, :]'}[k_axis]}")
            inner.line(f"kpmask = kp < {k_extent}")
            v = em.emit(st.value, inner)
            total = {None: "tl.sum(v_p)", 0: "tl.sum(v_p, axis=0)[None, :]", 1: "tl.sum(v_p, axis=1)[:, None]"}[k_axis]
            inner.line(f"v_p = tl.where(kpmask, {v}, 0.0)")
            inner.line(f"{name} += {total}")
        em.named[st.name] = name


def row_pass_step(k: int, rows: int) -> int:
    """k per step of a row pass over `rows` rows: [rows, step] tiles of at most ROW_PASS_ELEMENTS."""
    return min(max(16, ROW_PASS_ELEMENTS // rows), 1 << max(0, (k - 1).bit_length()))


def _bind_row(em: Emitter, i: int) -> None:
    """Point the row pass's names at GEMV row i's values."""
    for st in em.row_pass:
        em.named[st.name] = f"{st.name}_r{i}"


def row_factors(a: E.Expr, names: set[str]) -> tuple[E.Expr, tuple[E.Ref, ...]]:
    """The A prologue without its row-constant factors (Refs to row-pass values in its product tree),
    and those factors: a GEMV tile multiplies each row's sum by them once, after the k loop."""
    if isinstance(a, E.Ref) and a.name in names:
        return E.Const(1.0), (a,)
    if isinstance(a, E.Binary) and a.op == "mul":
        (ra, fa), (rb, fb) = row_factors(a.a, names), row_factors(a.b, names)
        rest = rb if ra == E.Const(1.0) else ra if rb == E.Const(1.0) else E.Binary("mul", ra, rb)
        return rest, fa + fb
    return a, ()


def _sum_in_loop(em: Emitter, scope: Scope, i: int) -> None:
    """A GEMV k step's part of row i's row-pass sums, at the k positions of `scope` (where the step's
    x loads are, which the sums share): accumulated per k position, summed after the loop."""
    mask = scope.axes["k"][1]
    for st in em.row_pass:
        if isinstance(st, Reduce):
            v = em.emit(st.value, scope)
            scope.line(f"{st.name}_part_r{i} += " + (f"tl.where({mask}, {v}, 0.0)" if mask else v))


def prologue_refs(e: E.Expr, pre: tuple[Stmt, ...]) -> bool:
    """Whether an expression still refers to row-pass values."""
    names = {st.name for st in pre}
    return any(isinstance(n, E.Ref) and n.name in names for n in E.walk(e))


def _x16_scaled(em: Emitter, operand: str) -> bool:
    """Whether x enters the fp16 pairs scaled by 2^-X16_SHIFT: bf16 x (for fp16's range), and x whose
    norm's inverse root was taken out of the prologue (not normalized: it may be large)."""
    return operand == "bf16" or bool(em.row_factors)


def _bare_load(e: E.Expr, lets: dict) -> E.Load | None:
    while isinstance(e, E.Ref) and e.name in lets:
        e = lets[e.name]
    return e if isinstance(e, E.Load) else None


def _load_words(em: Emitter, scope: Scope, word: E.Load, kmask: bool) -> str:
    """Load the tile's packed words once, [block_k / 8, block_n]."""
    t = word.tensor
    scope.line(f"kw_{t} = k0 // 8 + tl.arange(0, BLOCK_K // 8)[:, None]")
    bound = f"(kw_{t} < {em.emit(em.op.tensors[t].shape[1], scope)})" if kmask else None
    mask = " & ".join(m for m in (scope.axes["c"][1], bound) if m)
    load = f"tl.load({t}_ptr + c.to(tl.int64) * {t}_s0 + kw_{t}" + (f", mask={mask}, other=0)" if mask else ")")
    scope.line(f"words_{t} = {load}")
    return f"words_{t}"


def _unpack_int4(em: Emitter, scope: Scope, word: E.Load, var: str, kmask: bool) -> None:
    """Unpack all eight codes of each of the tile's words into a [block_k, block_n] tile in k order
    (as fp32 values: they only ever meet the float dequantization arithmetic)."""
    words = _load_words(em, scope, word, kmask)
    # Codes become exact fp32 values without an int-to-float conversion (a quarter-rate instruction):
    # 2^23 + code has the code in its low mantissa bits, so OR in 2^23's exponent and subtract 2^23.
    scope.line(f"{var} = tl.reshape(((tl.reshape({words}, [BLOCK_K // {INT4_PERIOD}, 1, {RUN}, BLOCK_N]) "
               f">> (tl.arange(0, 8) * 4)[None, :, None, None]) & 15) | 0x4B000000, [BLOCK_K, BLOCK_N])"
               f".to(tl.float32, bitcast=True) - {MAGIC}")
    em.named[var] = var


def _code_k(em: Emitter, con: Contract, scope: Scope, kmask: bool, j: int) -> None:
    """`ka{j}` (and `kmask{j}`), the k at which code j of each of the tile's [block_k / 8] words meets
    x: 128 * (w // 16) + 16 * j + w % 16 (flashgen/quant.py's layout); code 0 also names `kw0`."""
    if j == 0:
        scope.line(f"kw0 = k0 + tl.arange(0, BLOCK_K // 8)[:, None] // {RUN} * {INT4_PERIOD} "
                   f"+ tl.arange(0, BLOCK_K // 8)[:, None] % {RUN}")
    scope.line(f"ka{j} = kw0 + {RUN * j}")
    if kmask:
        scope.line(f"kmask{j} = ka{j} < {em.emit(con.extent, scope)}")


def segment_runs(affine: tuple, dims: dict[str, int], block_k: int) -> int:
    """How many consecutive runs of RUN k share one zero point and scale, counted from a k step's start:
    segments must divide both the groups and the k step (G=48 under 128-deep steps: one run each)."""
    _, zero, scale = affine
    periods = [p for p in (prologue.k_period(e, dims) for e in (zero, scale) if e is not None) if p is not None]
    return math.gcd(*periods, block_k) // RUN


def _int4_terms(em: Emitter, con: Contract, affine: tuple, per_segment: int, b_scope: Scope,
                kmask: bool) -> list[tuple[str | None, list[tuple[str, str | None, str, float]]]]:
    """A GEMV k step's weights for int4 codes `(code - zero) * scale`: eight [block_k / 8, block_n]
    tiles, code j of every word, which meets x at k = 128 * (word // 16) + 16 * j + word % 16. The
    words are never reshaped, so they stay in the registers and layout they were loaded in. A code
    costs three instructions: an AND-OR that puts code * 16^j' in an fp32 mantissa (j' = j, or j - 3
    after one shift of the word by 12 for j >= 5), one add that removes 2^23 + zero * 16^j', and the
    FMA with x * 16^-j'; the scale multiplies each segment's sum (codes sharing a group) once.
    Returns, per segment, its scale and (k, k mask, weight tile, x factor) per code position."""
    word, zero, scale = affine
    words = _load_words(em, b_scope, word, kmask)
    b_scope.line(f"{words}_hi = {words} >> 12")
    segments = []
    for j in range(8):
        _code_k(em, con, b_scope, kmask, j)
        if j % per_segment == 0:
            seg = b_scope.child(axes={"c": b_scope.axes["c"], "k": (f"ka{j}", f"kmask{j}" if kmask else None)},
                                fresh=True)
            z = em.emit(zero, seg)
            segments.append((em.emit(scale, seg) if scale is not None else None, []))
        src, jj = (words, j) if j < 5 else (f"{words}_hi", j - 3)
        b_scope.line(f"w{j} = (({src} & {15 << 4 * jj}) | magic).to(tl.float32, bitcast=True) "
                     f"- ({MAGIC} + {z} * {16.0 ** jj})")
        segments[-1][1].append((f"ka{j}", f"kmask{j}" if kmask else None, f"w{j}", 16.0 ** -jj))
    return segments


def _group_affine(em: Emitter, affine: tuple, scope: Scope, k: tuple, operand: str) -> tuple[str | None, str, str | None]:
    """The fp16-pair terms' group constants at the codes' k positions `k`: the zero point (None for
    8, which the PTX dot subtracts itself), the factor that undoes bf16 x's 2^-8 and the scale."""
    _, zero, scale = affine
    seg = scope.child(axes={"c": scope.axes["c"], "k": k}, fresh=True)
    offset = None if zero == E.Const(8) else em.emit(zero, seg)
    factor = f" * {2.0 ** X16_SHIFT}" if _x16_scaled(em, operand) else ""
    return offset, factor, em.emit(scale, seg) if scale is not None else None


# (x_j, x_j+4) in one fp16 pair: one conversion of both fp32 values (x_j in the low half)
X_PAIR_PTX = "cvt.rn.f16x2.f32 $0, $2, $1;"


def _x_pairs(em: Emitter, con: Contract, scope: Scope, row: int, kmask: bool, operand: str) -> list[str]:
    """Row `row`'s x at the eight code positions as four fp16 pairs `xq0..xq3` (x_j low, x_j+4 high,
    in int32 lanes); returns the x expressions, which a zero point sums. x that is scaled by 2^-8
    first (bf16 x, for fp16's range) goes through fp32 anyway: one paired conversion packs two (5%
    fewer k-loop instructions in the bf16 one-stage quad tile, by SASS count); fp16 x is already
    16 bits, and its bit patterns are paired with integer ops (a detour through fp32 costs more)."""
    scope.line(f"rmask{row} = r{row} < {em.emit(em.op.domain[0], scope)}")
    _bind_row(em, row)
    scaled = _x16_scaled(em, operand)
    xs, halves = [], []
    for j in range(8):
        axes = {"r": (f"r{row}", f"rmask{row}"), "k": (f"ka{j}", f"kmask{j}" if kmask else None)}
        x_scope = scope.child(axes=axes, fresh=True)
        x = em.emit(con.a, x_scope)
        if em.row_factors:
            _sum_in_loop(em, x_scope, row)
        if scaled:
            halves.append(f"({x}.to(tl.float32) * {2.0 ** -X16_SHIFT})")
        else:
            scope.line(f"xh{j} = {x}.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF")
            halves.append(f"xh{j}")
        xs.append(x)
    for q in range(4):
        if scaled:
            scope.line(f"xq{q} = tl.inline_asm_elementwise(\"{X_PAIR_PTX}\", \"=r,f,f\", [{halves[q]}, "
                       f"{halves[q + 4]}], dtype=tl.int32, is_pure=True, pack=1)")
        else:
            scope.line(f"xq{q} = {halves[q]} | ({halves[q + 4]} << 16)")
    return xs


def _int4_pair_terms(em: Emitter, con: Contract, affine: tuple, words: str, scope: Scope, block_m: int,
                     kmask: bool, operand: str) -> None:
    """A GEMV k step of int4 codes on the ALUs in fp16 pairs (`ptx_unpack`): per word and row, one
    inline-PTX dot of its eight codes with x (`_ptx_word_dot`, about two instructions per code against
    three in fp32), then `part += dot * scale` in fp32. Code j of word w meets x at k = 128 * (w // 16)
    + 16 * j + w % 16, so the pairs (j, j + 4) meet x 64 apart; every code of a word shares its group
    (the rules ask for groups of 128 k or more). A zero point other than 8 adds (8 - zero) times the
    word's sum of x. bf16 x enters fp16 scaled by 2^-8, and the dot is scaled back."""
    for j in range(8):
        _code_k(em, con, scope, kmask, j)
    offset, factor, scale_v = _group_affine(em, affine, scope, ("ka0", "kmask0" if kmask else None), operand)
    for i in range(block_m):
        xs = _x_pairs(em, con, scope, i, kmask, operand)
        for q in range(4):
            scope.line(f"xp{q} = tl.broadcast_to(xq{q}, [BLOCK_K // 8, BLOCK_N])")
        scope.line(f"d{i} = tl.inline_asm_elementwise(\"{_ptx_word_dot()}\", \"=r,r,r,r,r,r\", "
                   f"[{words}, xp0, xp1, xp2, xp3], dtype=tl.float32, is_pure=True, pack=1){factor}")
        if offset is not None:
            total = " + ".join(f"{x}.to(tl.float32)" for x in xs)
            scope.line(f"d{i} += (8.0 - {offset}) * ({total})")
        scope.line(f"part{i} += d{i}" + (f" * {scale_v}" if scale_v else ""))


def _quads(v: str, cols: str) -> str:
    """A [block_k / 8, cols] tile as its four [block_k / 32, cols] tiles of words 4 a + i (in the order
    i = 0, 2 / 1, 3 that two splits give)."""
    return (f"tl.reshape(tl.permute(tl.reshape({v}, [BLOCK_K // 32, 4, {cols}]), (0, 2, 1)), "
            f"[BLOCK_K // 32, {cols}, 2, 2])")


def _int4_quad_terms(em: Emitter, con: Contract, affine: tuple, words: str, scope: Scope, block_m: int,
                     kmask: bool, operand: str) -> None:
    """`_int4_pair_terms` over quads of consecutive words (`ptx_unpack=2`): the words tile and the x
    pairs split into four [block_k / 32, ...] tiles, word 4 a + i of each row in tile i (a split in
    registers where a thread holds four consecutive words, as 16-byte loads give it), and one
    inline-PTX dot (`_ptx_quad_dot`) sums a quad's 32 codes, which share their group, before one
    `part += dot * scale`."""
    for j in range(8):
        _code_k(em, con, scope, kmask, j)

    def split4(v: str, cols: str, name: str) -> list[str]:
        scope.line(f"{name}_lo, {name}_hi = tl.split({_quads(v, cols)})")
        scope.line(f"{name}0, {name}2 = tl.split({name}_lo)")
        scope.line(f"{name}1, {name}3 = tl.split({name}_hi)")
        return [f"{name}{i}" for i in range(4)]

    ws = split4(words, "BLOCK_N", "w")
    scope.line(f"kq = k0 + 4 * tl.arange(0, BLOCK_K // 32)[:, None] // {RUN} * {INT4_PERIOD} "
               f"+ 4 * tl.arange(0, BLOCK_K // 32)[:, None] % {RUN}")  # code 0 of each quad's first word
    if kmask:
        scope.line(f"kqmask = kq < {em.emit(con.extent, scope)}")
    offset, factor, scale_v = _group_affine(em, affine, scope, ("kq", "kqmask" if kmask else None), operand)
    for r in range(block_m):
        xs = _x_pairs(em, con, scope, r, kmask, operand)
        pairs = [split4(f"xq{q}", "1", f"xp{q}_") for q in range(4)]
        args = ", ".join(f"tl.broadcast_to({pairs[q][i]}, [BLOCK_K // 32, BLOCK_N])" for i in range(4) for q in range(4))
        scope.line(f"d{r} = tl.inline_asm_elementwise(\"{_ptx_quad_dot()}\", \"={','.join(['r'] * 21)}\", "
                   f"[{', '.join(ws)}, {args}], dtype=tl.float32, is_pure=True, pack=1){factor}")
        if offset is not None:
            total = " + ".join(f"{x}.to(tl.float32)" for x in xs)
            sums = split4(f"({total})", "1", "xs_")
            scope.line(f"d{r} += (8.0 - {offset}) * ({' + '.join(sums)})")
        scope.line(f"part{r} += d{r}" + (f" * {scale_v}" if scale_v else ""))


def _gemv(em: Emitter, con: Contract, b_expr: E.Expr, unpacked: dict, grouped: dict, affine: tuple | None,
          per_segment: int, top: Scope, b_scope: Scope, s: Schedule, kmask: bool, acc: str, operand: str,
          row_step: int) -> None:
    """The k loop of a tile of fewer rows than a matrix instruction takes, on the ALUs (`top` is the
    scope around the loop, `b_scope` its body): the weight tile is multiplied, in the layout it was
    loaded in, by a column of x per row, into a tile of partial sums per row that is summed over k only
    after the loop. No operand layout, no shared-memory round trip, one FMA per weight and row; int4
    codes take `_int4_terms`' route when their zero point and scale allow it (`_int4_pair_terms`' with
    `ptx_unpack`). With `early_load`, the
    first k step's weights (which no kernel writes) are loaded before the wait for the previous kernel
    (`grid_dependency`), so that a GEMV's first DRAM round trip overlaps the kernel before it; only
    x and what follows wait. An unsplit tile sums its row pass's reductions in the k loop, over the x
    it loads (`_sum_in_loop`), and scales each row's sum by the factors taken out of the prologue
    (`row_factors`) after it; a split tile runs the row pass (`_row_pass`) per row after the wait."""
    rows = em.emit(em.op.domain[0], top)
    acc_t = ACC[con.acc]
    block_m = s["block_m"]
    for i in range(block_m):
        top.line(f"r{i} = pid_m * BLOCK_M + {i}")
        per = (" // 32" if s.get("ptx_unpack") == 2 else " // 8") if affine else ""
        top.line(f"part{i} = tl.zeros([BLOCK_K{per}, BLOCK_N], dtype={acc_t})")
    if affine and not s.get("ptx_unpack"):
        # 2^23's exponent, in a form the compiler cannot fold (M is never negative): kept in a
        # register, it lets one LOP3 do both the AND and the OR of each code.
        top.line(f"magic = 0x4B000000 | ({rows} >> 31)")

    in_loop = bool(em.row_factors)  # the row pass's sums accumulate in the k loop, over x it loads anyway
    for i in range(block_m) if in_loop else ():
        for st in em.row_pass:
            if isinstance(st, Reduce):
                top.line(f"{st.name}_part_r{i} = tl.zeros([BLOCK_K{' // 8' if affine else ''}, 1], dtype=tl.float32)")

    def row_passes(scope: Scope) -> None:
        for i in range(block_m) if not in_loop else ():
            _row_pass(em, con, scope, f"r{i}", None, row_step, f"_r{i}")

    if not s.get("early_load"):
        row_passes(top)

    def k_step(scope: Scope, before_x: bool = False) -> None:
        """One k step at k0: the weight terms, then (after the wait when `before_x`) x and the products."""
        if affine and s.get("ptx_unpack"):
            words = _load_words(em, scope, affine[0], kmask)
            if before_x:
                grid_dependency(scope)
                row_passes(scope)
            terms = _int4_quad_terms if s["ptx_unpack"] == 2 else _int4_pair_terms
            terms(em, con, affine, words, scope, block_m, kmask, operand)
            return
        if affine:
            segments = _int4_terms(em, con, affine, per_segment, scope, kmask)
        else:
            _b_tile_values(em, con, unpacked, grouped, scope, kmask)
            w = em.temp(scope, f"{em.emit(b_expr, scope)}.to({acc_t})")
            segments = [(None, [("kb", "kmask_b" if kmask else None, w, 1.0)])]
        if before_x:
            grid_dependency(scope)
            row_passes(scope)
        for i in range(block_m):
            scope.line(f"rmask{i} = r{i} < {rows}")
            _bind_row(em, i)
            sums = []
            for scale, terms in segments:
                products = []
                for k, kmask_k, w, factor in terms:
                    x_scope = scope.child(axes={"r": (f"r{i}", f"rmask{i}"), "k": (k, kmask_k)}, fresh=True)
                    x = em.emit(con.a, x_scope)
                    if in_loop:
                        _sum_in_loop(em, x_scope, i)
                    products.append(f"{x}.to({acc_t})" + (f" * {factor}" if factor != 1.0 else "") + f" * {w}")
                sums.append(f"({' + '.join(products)}) * {scale}" if scale else " + ".join(products))
            scope.line(f"part{i} += " + " + ".join(sums))

    first = "k_lo"
    if s.get("early_load"):  # the first k step, peeled: its weights before the wait (k_lo < k_hi: no splits)
        top.line("k0 = k_lo")
        k_step(b_scope.child(top.indent, fresh=True), before_x=True)
        first = "k_lo + BLOCK_K"
    # Loads that feed no matrix instruction are software-pipelined only when the loop asks.
    top.line(f"for k0 in tl.range({first}, k_hi, BLOCK_K, num_stages={s['num_stages']}):")
    k_step(b_scope)
    top.line("row_ids = tl.arange(0, BLOCK_M)[:, None]")
    for i in range(block_m):
        scaled = ""
        if in_loop:  # the row pass's values from the summed parts, then the factors taken out of x
            _row_pass(em, con, top, f"r{i}", None, row_step, f"_r{i}", summed=True)
            scaled = "".join(f" * {em.emit(f, top.child(fresh=True))}" for f in em.row_factors)
        top.line(f"{acc} = tl.where(row_ids == {i}, (tl.sum(part{i}, axis=0){scaled})[None, :], {acc})")


def _operand_tile(em: Emitter, e: E.Expr, scope: Scope, lets: dict, operand: str) -> str:
    """An operand tile of a matrix instruction, loaded in the operand dtype when it is stored in it."""
    load = _bare_load(e, lets)
    raw = load is not None and em.op.dtype_of(load.tensor, em.attrs) == operand
    v = em.emit(e, scope, raw=raw)
    return v if raw else em.temp(scope, f"{v}.to({dtypes.TL[operand]})")


def _joined(tiles: list[str]) -> str:
    """Tiles of 16 k (code positions j, j+1, ...) as one [block_n, 16 * n] tile in k order: joined in
    a tree (each join appends a dimension held in registers: the last one is the position's highest
    bit), the position's bits moved before the 16 words, highest first, and reshaped. Triton's layouts make all of it a renaming of registers into the
    matrix instruction's operand layout."""
    if len(tiles) == 1:
        return tiles[0]

    def tree(ts: list[str]) -> str:
        return ts[0] if len(ts) == 1 else f"tl.join({tree(ts[:len(ts) // 2])}, {tree(ts[len(ts) // 2:])})"

    bits = len(tiles).bit_length() - 1
    order = (0, *range(bits + 1, 1, -1), 1)
    return f"tl.reshape(tl.permute({tree(tiles)}, {order}), [BLOCK_N, {RUN * len(tiles)}])"


def _mma_int4(em: Emitter, con: Contract, lets: dict, affine: tuple, per_segment: int, top: Scope, body: Scope,
              s: Schedule, kmask: bool, acc: str, operand: str) -> None:
    """The k loop of a matrix tile of int4 codes `(code - zero) * scale`, computed transposed:
    acc^T [block_n, block_m] = W x^T, so that the weight is the instruction's A operand, which Hopper's
    warpgroup MMA reads from registers. Each k step loads [block_n, 16] words per 128 k; code j of
    those words is a run of 16 consecutive k. A code costs an AND-OR with a 16-bit float's exponent
    (1024 or 128 + code, exact) and a paired subtraction of 1032 or 136; the runs of a dot are joined
    into one operand tile (`_joined`) without moving data, so shared memory holds packed words, never
    a dequantized tile. Dots span the runs sharing a group (up to 128 k) and sum per segment before the
    segment's scale; a zero point other than 8 adds (8 - zero) times the segment's sum of x."""
    word, zero, scale = affine
    rows, cols = em.emit(em.op.domain[0], top), em.emit(em.op.domain[1], top)
    t = word.tensor
    cmask = "cmask_t" if top.axes["c"][1] else None
    top.line("r_t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]")
    top.line(f"rmask_t = r_t < {rows}")
    top.line("c_t = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]")
    if cmask:
        top.line(f"cmask_t = c_t < {cols}")
    top.line(f"{acc}_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)")
    top.line("for k0 in range(k_lo, k_hi, BLOCK_K):")
    magic, base = INT4_MAGIC[operand]
    k_extent = em.emit(con.extent, body)
    offset = None if zero == E.Const(8) else zero
    oscale = bool(s.get("operand_scale"))  # the scale multiplies the operand: no second accumulator
    direct = oscale or not prologue.segment_sums(affine)
    per_dot = min(per_segment, 8) & -min(per_segment, 8)  # runs per dot: a power of two within one block
    for q in range(0, s["block_k"] // RUN, per_dot):
        b, j = divmod(q, 8)
        if j == 0:
            body.line(f"kw{b} = k0 // 8 + {RUN * b} + tl.arange(0, {RUN})[None, :]")
            bound = f"(kw{b} < {em.emit(em.op.tensors[t].shape[1], body)})" if kmask else None
            mask = " & ".join(m for m in (cmask, bound) if m)
            body.line(f"words{b} = tl.load({t}_ptr + c_t.to(tl.int64) * {t}_s0 + kw{b}"
                      + (f", mask={mask}, other=0)" if mask else ")"))
        body.line(f"kx{q} = k0 + {RUN * q} + tl.arange(0, {RUN * per_dot})[:, None]")
        if kmask:
            body.line(f"kxm{q} = kx{q} < {k_extent}")
        x_scope = body.child(axes={"r": ("r_t", "rmask_t"), "k": (f"kx{q}", f"kxm{q}" if kmask else None)}, fresh=True)
        x = _operand_tile(em, con.a, x_scope, lets, operand)
        runs = []
        if oscale and j == 0:  # one scale per row and block of 128 k (the rules ask for groups of 128 k or more)
            body.line(f"ksc{b} = k0 + {INT4_PERIOD * b}")
            if kmask:
                body.line(f"kscm{b} = ksc{b} < {k_extent}")
            sc_scope = body.child(axes={"c": ("c_t", cmask), "k": (f"ksc{b}", f"kscm{b}" if kmask else None)}, fresh=True)
            body.line(f"sc{b} = tl.broadcast_to(({em.emit(scale, sc_scope)}).to({dtypes.TL[operand]}), [BLOCK_N, {RUN}])")
        for jj in range(j, j + per_dot):
            if oscale:
                body.line(f"c{jj} = tl.inline_asm_elementwise(\"{_ptx_codes(operand, jj, scaled=True)}\", \"=r,r,r,r\", "
                          f"[words{b}, sc{b}], dtype={dtypes.TL[operand]}, is_pure=True, pack=2)")
            elif s.get("ptx_unpack"):
                body.line(f"c{jj} = tl.inline_asm_elementwise(\"{_ptx_codes(operand, jj)}\", \"=r,r,r\", [words{b}], "
                          f"dtype={dtypes.TL[operand]}, is_pure=True, pack=2)")
            else:
                shifted = f"words{b}" if jj == 0 else f"(words{b} >> {4 * jj})"
                body.line(f"c{jj} = (({shifted} & 15) | {magic}).to(tl.int16).to({dtypes.TL[operand]}, bitcast=True) "
                          f"- {base + 8.0}")
            runs.append(f"c{jj}")
        body.line(f"w{q} = {_joined(runs)}")
        if direct:
            body.line(f"{acc}_t = tl.dot(w{q}, {x}, {acc}_t)")
            continue
        if q % per_segment == 0:
            body.line("seg = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)")
            if offset is not None:
                body.line("xs = tl.zeros([1, BLOCK_M], dtype=tl.float32)")
        body.line(f"seg = tl.dot(w{q}, {x}, seg)")
        if offset is not None:
            body.line(f"xs += tl.sum({x}.to(tl.float32), axis=0)[None, :]")
        if (q + per_dot) % per_segment == 0:
            first = q + per_dot - per_segment
            body.line(f"kseg{first} = k0 + {RUN * first}")
            seg_mask = None
            if kmask:
                body.line(f"ksegm{first} = kseg{first} < {k_extent}")
                seg_mask = f"ksegm{first}"
            seg_scope = body.child(axes={"c": ("c_t", cmask), "k": (f"kseg{first}", seg_mask)}, fresh=True)
            value = "seg" if offset is None else f"(seg + (8.0 - {em.emit(offset, seg_scope)}) * xs)"
            body.line(f"{acc}_t += {value}" + (f" * {em.emit(scale, seg_scope)}" if scale is not None else ""))
    top.line(f"{acc} = tl.trans({acc}_t)")


def _group_rows(em: Emitter, scope: Scope, load: E.Load, var: str, k_extent: E.Expr | None) -> None:
    """Load the tile's block_k / G group rows of a [c, k // G] tensor once and repeat each G times:
    the load runs with k standing for the first k of each group."""
    g = em.emit(load.indices[1].b, scope)
    kg = f"kg_{load.tensor}"
    scope.line(f"{kg} = k0 + (tl.arange(0, BLOCK_K // {g}) * {g})[:, None]")
    mask = f"{kg}_mask" if k_extent is not None else None
    if mask:
        scope.line(f"{mask} = {kg} < {em.emit(k_extent, scope)}")
    rows = em.emit(load, scope.child(axes={**scope.axes, "k": (kg, mask)}, fresh=True))
    scope.line(f"{var} = tl.reshape(tl.broadcast_to({rows}[:, None, :], [BLOCK_K // {g}, {g}, BLOCK_N]), "
               "[BLOCK_K, BLOCK_N])")
    em.named[var] = var


def _b_tile_values(em: Emitter, con: Contract, unpacked: dict, grouped: dict, b_scope: Scope, kmask: bool) -> None:
    """A k step's [block_k, block_n] indices of the weight tile, its unpacked int4 codes and its
    group rows (what the rewritten prologue refers to)."""
    b_scope.line("kb = k0 + tl.arange(0, BLOCK_K)[:, None]")
    if kmask:
        b_scope.line(f"kmask_b = kb < {em.emit(con.extent, b_scope)}")
    for word, var in unpacked.items():
        _unpack_int4(em, b_scope, word, var, kmask)
    for load, var in grouped.items():
        _group_rows(em, b_scope, load, var, con.extent if kmask else None)


def _tma_k_loop(em: Emitter, con: Contract, tensors: tuple[str, str], top: Scope, body: Scope, acc: str) -> None:
    """The k loop of a tile whose A and W tiles TMA descriptors copy (built on the device, in global
    scratch the launcher provides): no address arithmetic or masks per thread, zeros past the edges."""
    for t, rows, block in zip(tensors, ("pid_m * BLOCK_M", "pid_n * BLOCK_N"), ("BLOCK_M", "BLOCK_N")):
        shape = ", ".join(em.emit(d, top) for d in em.op.tensors[t].shape)
        top.line(f"{t}_desc = tl.make_tensor_descriptor({t}_ptr, shape=[{shape}], strides=[{t}_s0, 1], "
                 f"block_shape=[{block}, BLOCK_K])")
    top.line("for k0 in range(k_lo, k_hi, BLOCK_K):")
    a, b = tensors
    body.line(f"{acc} = tl.dot({a}_desc.load([pid_m * BLOCK_M, k0]), {b}_desc.load([pid_n * BLOCK_N, k0]).T, {acc}, "
              f"out_dtype={ACC[con.acc]})")


def _k_loop(em: Emitter, con: Contract, lets: dict, b_expr: E.Expr, unpacked: dict, grouped: dict,
            top: Scope, b_scope: Scope, kmask: bool, acc: str, operand: str) -> None:
    """The k loop of a tile: A and B tiles through their prologues, then `tl.dot`."""
    top.line("for k0 in range(k_lo, k_hi, BLOCK_K):")
    a_scope = b_scope.child(axes={"r": ("r", "rmask"), "k": ("ka", "kmask_a" if kmask else None)}, fresh=True)
    a_scope.line("ka = k0 + tl.arange(0, BLOCK_K)[None, :]")
    if kmask:
        a_scope.line(f"kmask_a = ka < {em.emit(con.extent, a_scope)}")
    _b_tile_values(em, con, unpacked, grouped, b_scope, kmask)
    tiles = [_operand_tile(em, e, scope, lets, operand) for e, scope in ((con.a, a_scope), (b_expr, b_scope))]
    b_scope.line(f"{acc} = tl.dot({tiles[0]}, {tiles[1]}, {acc}, out_dtype={ACC[con.acc]})")


def _split_scratch(bm: int, bn: int, split_k: int, acc: str) -> tuple[Scratch, ...]:
    """Per (tile, split) the partial accumulator tile, and per tile a counter of finished splits."""
    tiles = lambda d: -(-d["M"] // bm) * -(-d["N"] // bn)  # noqa: E731
    return (Scratch("part", "fp32" if acc == "fp32" else "int32", lambda d: tiles(d) * split_k * bm * bn),
            Scratch("done", "int32", tiles, zeroed=True))


def _merge_splits(top: Scope, acc: str, acc_type: str) -> Scope:
    """Split-K: each split stores its partial tile; the last split of a tile to finish adds all of them
    in split order (the sum does not depend on which finished last), resets the tile's counter, and
    returns the scope (inside its branch) where the epilogue goes."""
    top.line("offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
    top.line(f"tl.store(part_ptr + (pid * SPLIT_K + split).to(tl.int64) * (BLOCK_M * BLOCK_N) + offs, {acc})")
    top.line("tl.debug_barrier()")
    top.line("finished = tl.atomic_add(done_ptr + pid, 1)  # acq_rel at gpu scope")
    top.line("if finished == SPLIT_K - 1:")
    last = top.child(top.indent + "    ")
    last.line("tl.debug_barrier()")
    last.line(f"{acc} = tl.zeros([BLOCK_M, BLOCK_N], dtype={ACC[acc_type]})")
    last.line("for i in tl.static_range(SPLIT_K):")
    last.line(f"    {acc} += tl.load(part_ptr + (pid * SPLIT_K + i).to(tl.int64) * (BLOCK_M * BLOCK_N) + offs, volatile=True)")
    last.line("tl.atomic_xchg(done_ptr + pid, 0)")
    return last


def generate_contraction(wl: Workload, s: Schedule) -> KernelSource:
    assert not s.get("dequant_first"), "a weight dequantized first is two kernels (targets/staged.py)"
    op, attrs = wl.op, wl.attr
    body = op.body(attrs)
    lets = {st.name: st.value for st in body if isinstance(st, Let)}
    [con] = [st for st in body if isinstance(st, Contract)]
    epilogue = body[body.index(con) + 1:]
    m_extent, n_extent = op.domain
    em = Emitter(op, attrs, lets)
    em.row_pass = body[:body.index(con)]
    name = f"{op.name}_kernel"
    split_k = s.get("split_k", 1)
    consts = {"BLOCK_M": s["block_m"], "BLOCK_N": s["block_n"], "BLOCK_K": s["block_k"], "GROUP_M": s["group_m"],
              "SPLIT_K": split_k}
    scratch = _split_scratch(s["block_m"], s["block_n"], split_k, con.acc) if split_k > 1 else ()
    args = kernel_args(wl, consts, scratch)
    lines = module_header(wl, s, name, args)
    n_val, k_val = eval_int(n_extent, wl.dim), eval_int(con.extent, wl.dim)
    cmask = "cmask" if n_val % s["block_n"] else None
    kmask = k_val % s["block_k"] != 0
    persistent = s.get("persistent", 0)
    outer = Scope(lines, "    ", {"r": ("r", "rmask"), "c": ("c", cmask)})
    rows, cols = em.emit(m_extent, outer), em.emit(n_extent, outer)
    if not persistent:
        outer.line("pid = tl.program_id(0)")
    outer.line(f"tiles_m = tl.cdiv({rows}, BLOCK_M)")
    outer.line(f"tiles_n = tl.cdiv({cols}, BLOCK_N)")
    top = outer
    if persistent:  # `persistent` programs per SM walk the tiles in launch order, pid being the tile
        grid_dependency(outer)
        outer.line("for pid in range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):")
        top = outer.child("        ")
    top.line("group = pid // (GROUP_M * tiles_n)")
    top.line("first_m = group * GROUP_M")
    top.line("size_m = tl.minimum(tiles_m - first_m, GROUP_M)")
    top.line("pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m")
    top.line("pid_n = (pid % (GROUP_M * tiles_n)) // size_m")
    top.line("r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
    top.line(f"rmask = r < {rows}")
    top.line("c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
    if cmask:
        top.line(f"cmask = c < {cols}")
    acc = f"acc_{con.name}"
    top.line(f"{acc} = tl.zeros([BLOCK_M, BLOCK_N], dtype={ACC[con.acc]})")
    k_extent = em.emit(con.extent, top)
    if split_k > 1:  # this program's share of K: whole k steps, the last share shorter
        top.line("split = tl.program_id(2)")
        top.line(f"k_span = tl.cdiv(tl.cdiv({k_extent}, SPLIT_K), BLOCK_K) * BLOCK_K")
        top.line("k_lo = split * k_span")
        top.line(f"k_hi = tl.minimum({k_extent}, k_lo + k_span)")
    else:
        top.line("k_lo = 0")
        top.line(f"k_hi = {k_extent}")
    if not persistent and not s.get("early_load"):
        grid_dependency(top)
    ind = top.indent + "    "
    b_scope = top.child(ind, {"c": ("c", cmask), "k": ("kb", "kmask_b" if kmask else None),
                              "k0": ("k0", None)}, fresh=True)
    unpacked: dict[E.Load, str] = {}
    grouped: dict[E.Load, str] = {}
    b_expr = prologue.rewrite(con.b, wl.dim, s["block_k"], unpacked, grouped)
    affine = int4_affine(wl) if s["block_k"] % INT4_PERIOD == 0 else None
    per_segment = segment_runs(affine, wl.dim, s["block_k"]) if affine else 0
    operand = operand_dtype(wl)
    gemv = s["block_m"] < MMA_MIN_ROWS
    row_step = row_pass_step(k_val, 1 if gemv else s["block_m"])
    if em.row_pass and gemv and split_k == 1:
        # An unsplit GEMV tile loads every x of its rows: the row pass's sums accumulate along with the
        # products, and its values scale each row's sum at the end, so nothing waits before the k loop.
        rest, factors = row_factors(con.a, {st.name for st in em.row_pass})
        if factors and not prologue_refs(rest, em.row_pass):
            con, em.row_factors = replace(con, a=rest), factors
    if em.row_pass and not gemv:
        if affine and operand in INT4_MAGIC:  # the transposed int4 tile reads x^T: rows along dim 1
            top.line("r_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]")
            _row_pass(em, con, top, "r_p", 0, row_step)
        else:
            _row_pass(em, con, top, "r", 1, row_step)
    if gemv:
        _gemv(em, con, b_expr, unpacked, grouped, affine, per_segment, top, b_scope, s, kmask, acc, operand, row_step)
    elif affine and operand in INT4_MAGIC:
        _mma_int4(em, con, lets, affine, per_segment, top, b_scope, s, kmask, acc, operand)
    elif s.get("tma"):
        _tma_k_loop(em, con, tma_operands(wl), top, b_scope, acc)
    else:
        _k_loop(em, con, lets, b_expr, unpacked, grouped, top, b_scope, kmask, acc, operand)
    em.named[con.name] = acc
    out = _merge_splits(top, acc, con.acc) if split_k > 1 else top
    for st in epilogue:
        if isinstance(st, Store):
            em.store(st, out)
    return KernelSource(name, "\n".join(lines) + "\n", args, (s["block_m"], s["block_n"]), tile_cols=True, flat=True,
                        grid_z=split_k, scratch=scratch, persistent=persistent)
