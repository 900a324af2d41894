"""int4 codes in GEMV tiles on the ALUs, the words never reshaped (they stay in the registers and
layout they were loaded in): per code in fp32 (`int4_terms`), or in fp16 pairs by inline PTX, a dot
per word (`pair_terms`, `ptx_unpack=1`) or per quad of consecutive words (`quad_terms`, 2)."""
from __future__ import annotations

import math

from flashgen.ir import expr as E
from flashgen.ir import prologue
from flashgen.quant import INT4_PERIOD
from flashgen.targets.triton.contraction import ptx
from flashgen.targets.triton.contraction.context import Tile
from flashgen.targets.triton.contraction.operands import MAGIC, RUN, load_words
from flashgen.targets.triton.contraction.row_pass import bind_row, sum_in_loop
from flashgen.targets.triton.emit import Scope

# x in fp16 is x * 2^-X16_SHIFT for bf16 activations, so that fp16's range covers bf16 values up to 2^24.
X16_SHIFT = 8


def segment_runs(affine: tuple, dims: dict[str, int], block_k: int) -> int:
    """How many consecutive runs of RUN k share one zero point and scale, counted from a k step's start:
    segments must divide both the groups and the k step (G=48 under 128-deep steps: one run each)."""
    _, zero, scale = affine
    periods = [p for p in (prologue.k_period(e, dims) for e in (zero, scale) if e is not None) if p is not None]
    return math.gcd(*periods, block_k) // RUN


def code_k(t: Tile, scope: Scope, j: int) -> None:
    """`ka{j}` (and `kmask{j}`), the k at which code j of each of the tile's [block_k / 8] words meets
    x: 128 * (w // 16) + 16 * j + w % 16 (flashgen/quant.py's layout); code 0 also names `kw0`."""
    if j == 0:
        scope.line(f"kw0 = k0 + tl.arange(0, BLOCK_K // 8)[:, None] // {RUN} * {INT4_PERIOD} "
                   f"+ tl.arange(0, BLOCK_K // 8)[:, None] % {RUN}")
    scope.line(f"ka{j} = kw0 + {RUN * j}")
    if t.kmask:
        scope.line(f"kmask{j} = ka{j} < {t.em.emit(t.con.extent, scope)}")


def magic_register(scope: Scope, rows: str) -> None:
    """`magic`, 2^23's exponent (the fp32 bits `int4_terms` ORs codes into), in a form the compiler
    cannot fold (`rows`, a row count, is never negative): kept in a register, it lets one LOP3 do both
    the AND and the OR of each code."""
    scope.line(f"magic = 0x4B000000 | ({rows} >> 31)")


def int4_terms(t: Tile, b_scope: Scope) -> list[tuple[str | None, list[tuple[str, str | None, str, float]]]]:
    """A GEMV k step's weights for int4 codes `(code - zero) * scale`: eight [block_k / 8, block_n]
    tiles, code j of every word, which meets x at k = 128 * (word // 16) + 16 * j + word % 16. A code
    costs three instructions: an AND-OR that puts code * 16^j' in an fp32 mantissa (j' = j, or j - 3
    after one shift of the word by 12 for j >= 5), one add that removes 2^23 + zero * 16^j', and the
    FMA with x * 16^-j'; the scale multiplies each segment's sum (codes sharing a group) once (`magic`:
    `magic_register`, emitted before the k loop). Returns, per segment, its scale and (k, k mask,
    weight tile, x factor) per code position."""
    em, kmask = t.em, t.kmask
    word, zero, scale = t.affine
    words = load_words(t, b_scope, word)
    b_scope.line(f"{words}_hi = {words} >> 12")
    segments = []
    for j in range(8):
        code_k(t, b_scope, j)
        if j % t.per_segment == 0:
            seg = b_scope.child(axes={**b_scope.axes, "k": (f"ka{j}", f"kmask{j}" if kmask else None)}, fresh=True)
            z = em.emit(zero, seg)
            segments.append((em.emit(scale, seg) if scale is not None else None, []))
        src, jj = (words, j) if j < 5 else (f"{words}_hi", j - 3)
        b_scope.line(f"w{j} = (({src} & {15 << 4 * jj}) | magic).to(tl.float32, bitcast=True) "
                     f"- ({MAGIC} + {z} * {16.0 ** jj})")
        segments[-1][1].append((f"ka{j}", f"kmask{j}" if kmask else None, f"w{j}", 16.0 ** -jj))
    return segments


def _x16_scaled(t: Tile) -> bool:
    """Whether x enters the fp16 pairs scaled by 2^-X16_SHIFT: bf16 x (for fp16's range), and x whose
    norm's inverse root was taken out of the prologue (not normalized: it may be large)."""
    return t.operand == "bf16" or bool(t.em.row_factors)


def _group_affine(t: Tile, scope: Scope, k: tuple) -> tuple[str | None, str, str | None]:
    """The fp16-pair terms' group constants at the codes' k positions `k`: the zero point (None for
    8, which the PTX dot subtracts itself), the factor that undoes bf16 x's 2^-8 and the scale."""
    _, zero, scale = t.affine
    seg = scope.child(axes={"c": scope.axes["c"], "k": k}, fresh=True)
    offset = None if zero == E.Const(8) else t.em.emit(zero, seg)
    factor = f" * {2.0 ** X16_SHIFT}" if _x16_scaled(t) else ""
    return offset, factor, t.em.emit(scale, seg) if scale is not None else None


def _x_pairs(t: Tile, scope: Scope, row: int) -> list[str]:
    """Row `row`'s x at the eight code positions as four fp16 pairs `xq0..xq3` (x_j low, x_j+4 high,
    in int32 lanes); returns the x expressions, which a zero point sums. x that is scaled by 2^-8
    first (bf16 x, for fp16's range) goes through fp32 anyway: one paired conversion packs two (5%
    fewer k-loop instructions in the bf16 one-stage quad tile, by SASS count); fp16 x is already
    16 bits, and its bit patterns are paired with integer ops (a detour through fp32 costs more)."""
    em = t.em
    scope.line(f"rmask{row} = r{row} < {em.emit(em.op.domain[0], scope)}")
    bind_row(em, row)
    scaled = _x16_scaled(t)
    xs, halves = [], []
    for j in range(8):
        axes = {"r": (f"r{row}", f"rmask{row}"), "k": (f"ka{j}", f"kmask{j}" if t.kmask else None)}
        x_scope = scope.child(axes=axes, fresh=True)
        x = em.emit(t.con.a, x_scope)
        if em.row_factors:
            sum_in_loop(em, x_scope, row)
        if scaled:
            halves.append(f"({x}.to(tl.float32) * {2.0 ** -X16_SHIFT})")
        else:
            scope.line(f"xh{j} = {x}.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF")
            halves.append(f"xh{j}")
        xs.append(x)
    for q in range(4):
        if scaled:
            scope.line(f"xq{q} = {ptx.x_pair(t)}({halves[q]}, {halves[q + 4]})")
        else:
            scope.line(f"xq{q} = {halves[q]} | ({halves[q + 4]} << 16)")
    return xs


def _add_dot(t: Tile, scope: Scope, r: int, offset: str | None, scale: str | None, x_sum: str | None) -> None:
    """part_r += the dot d_r (plus (8 - zero) times its x sum), times the group scale."""
    if offset is not None:
        scope.line(f"d{r} += (8.0 - {offset}) * ({x_sum})")
    scope.line(f"part{r} += d{r}" + (f" * {scale}" if scale else ""))


def pair_terms(t: Tile, words: str, scope: Scope) -> None:
    """A GEMV k step of int4 codes on the ALUs in fp16 pairs (`ptx_unpack`): per word and row, one
    inline-PTX dot of its eight codes with x (about two instructions per code against three in fp32),
    then `part += dot * scale` in fp32. Code j of word w meets x at k = 128 * (w // 16) + 16 * j +
    w % 16, so the pairs (j, j + 4) meet x 64 apart; every code of a word shares its group (the rules
    ask for groups of 128 k or more). A zero point other than 8 adds (8 - zero) times the word's sum
    of x. bf16 x enters fp16 scaled by 2^-8, and the dot is scaled back."""
    for j in range(8):
        code_k(t, scope, j)
    offset, factor, scale = _group_affine(t, scope, ("ka0", "kmask0" if t.kmask else None))
    for i in range(t.schedule["block_m"]):
        xs = _x_pairs(t, scope, i)
        for q in range(4):
            scope.line(f"xp{q} = tl.broadcast_to(xq{q}, [BLOCK_K // 8, BLOCK_N])")
        scope.line(f"d{i} = {ptx.word_dot(t)}({words}, xp0, xp1, xp2, xp3){factor}")
        total = " + ".join(f"{x}.to(tl.float32)" for x in xs)
        _add_dot(t, scope, i, offset, scale, total)


def _quads(v: str, cols: str) -> str:
    """A [block_k / 8, cols] tile as its four [block_k / 32, cols] tiles of words 4 a + i (in the order
    i = 0, 2 / 1, 3 that two splits give)."""
    return (f"tl.reshape(tl.permute(tl.reshape({v}, [BLOCK_K // 32, 4, {cols}]), (0, 2, 1)), "
            f"[BLOCK_K // 32, {cols}, 2, 2])")


def quad_terms(t: Tile, words: str, scope: Scope) -> None:
    """`pair_terms` over quads of consecutive words (`ptx_unpack=2`): the words tile and the x pairs
    split into four [block_k / 32, ...] tiles, word 4 a + i of each row in tile i (a split in
    registers where a thread holds four consecutive words, as 16-byte loads give it), and one
    inline-PTX dot sums a quad's 32 codes, which share their group, before one `part += dot * scale`."""
    for j in range(8):
        code_k(t, scope, j)

    def split4(v: str, cols: str, name: str) -> list[str]:
        scope.line(f"{name}_lo, {name}_hi = tl.split({_quads(v, cols)})")
        scope.line(f"{name}0, {name}2 = tl.split({name}_lo)")
        scope.line(f"{name}1, {name}3 = tl.split({name}_hi)")
        return [f"{name}{i}" for i in range(4)]

    ws = split4(words, "BLOCK_N", "w")
    scope.line(f"kq = k0 + 4 * tl.arange(0, BLOCK_K // 32)[:, None] // {RUN} * {INT4_PERIOD} "
               f"+ 4 * tl.arange(0, BLOCK_K // 32)[:, None] % {RUN}")  # code 0 of each quad's first word
    if t.kmask:
        scope.line(f"kqmask = kq < {t.em.emit(t.con.extent, scope)}")
    offset, factor, scale = _group_affine(t, scope, ("kq", "kqmask" if t.kmask else None))
    for r in range(t.schedule["block_m"]):
        xs = _x_pairs(t, scope, r)
        pairs = [split4(f"xq{q}", "1", f"xp{q}_") for q in range(4)]
        args = ", ".join(f"tl.broadcast_to({pairs[q][i]}, [BLOCK_K // 32, BLOCK_N])" for i in range(4) for q in range(4))
        scope.line(f"d{r} = {ptx.quad_dot(t)}({', '.join(ws)}, {args}){factor}")
        x_sum = None
        if offset is not None:
            total = " + ".join(f"{x}.to(tl.float32)" for x in xs)
            x_sum = " + ".join(split4(f"({total})", "1", "xs_"))
        _add_dot(t, scope, r, offset, scale, x_sum)
