"""Matrix tiles of gemm_w4a8's `lanes` codes (flashgen/quant.py `pack_int4_lanes`): signed nibbles that
one AND turns into four int8 lanes, summed by int8 matrix instructions into int32.

A word holds k = 32b + 4t + i (i = 0..3) in the high nibbles of its bytes and k = 32b + 16 + 4t + i in
the low ones: `word & 0xF0F0F0F0` is four int8 lanes (u - 8) * 16, `(word << 4) & 0xF0F0F0F0` the
other four, two word instructions and a shift for eight codes (the k128 layout's integer unpack costs a
shift, an AND, a subtraction, a multiply by the group scale and a conversion per code, and reshapes the
codes across threads). The lanes are in the k order an int8 matrix instruction's thread holds (4t..4t+3
and 16+4t..16+4t+3 of each 32 k), so the byte tiles are joined and permuted into [block_n, k], never
moved. The tile is computed transposed, acc^T [block_n, block_m] = W x^T, so that the weight is the
instruction's A operand (registers; Hopper's warpgroup MMA reads A from there).

With `operand_scale` (tile_lanes_scaled) each group's integer scale s multiplies its lanes before the
instruction, so that every group sums into one int32 tile (no group epilogue between the instructions):
per byte the code u = n ^ 8 (every nibble's sign bit flipped once per word, one XOR for eight codes,
then a nibble n masked out: Triton's code gives ptxas two constants, which it does not fuse into one
LOP3, so flipping per word saves one instruction in eight codes), then u * s + 128 - 8 s in [0, 240]
(one IMAD on four lanes: no byte carries into the next), and the bit 128 of each byte flipped (one
XOR) is (u - 8) * s in [-128, 112] as int8, the operand's exact value.

Otherwise scales stay exact: the products are 16x their value, so a group's int32 sum (a whole k step, or a
part of one that holds whole groups: `lane_segment`) is a multiple of 16, which an arithmetic shift
divides out exactly before the group's integer scale multiplies it into the int32 accumulator; per
channel, the accumulator sums the 16x products and is shifted once after the loop. Either way every
partial sum is bounded by K * 128 * 128 (|x| <= 128, |(u - 8) * s_group| <= 128, and a group's 16x sum
by G * 128 * 128): exact in int32 for K <= 131071 (gemm_w4a8 refuses larger K).
"""
from __future__ import annotations

from flashgen.ir import expr as E
from flashgen.ir.variants import variant
from flashgen.quant import LANE_BLOCK, LANE_MASK
from flashgen.targets.triton.contraction.context import Tile
from flashgen.targets.triton.contraction.operands import operand_tile

MASK = LANE_MASK - (1 << 32)  # 0xF0F0F0F0 as the int32 it is in the word's register
LANE_SHIFT = 4  # log2 of the 16 by which the high-nibble lanes scale each code
LOW = 0x0F0F0F0F  # each byte's low nibble
NIBBLE_SIGNS = 0x88888888 - (1 << 32)  # every nibble's sign bit, as an int32: n ^ 8 is the code u
BYTE_SIGN = 0x80808080 - (1 << 32)  # each byte's top bit, as an int32
ONES = 0x01010101  # a byte value in each of four lanes


def _lanes(words: str, depth: str, scale: str | None = None) -> tuple[str, str]:
    """The [block_n, depth] int8 tile of a [block_n, depth / 8] words tile, in two statements (the
    second reads the first as `h`): per word the high-nibble lanes and the low-nibble ones joined (AND,
    and shift, AND: (u - 8) * 16; with a [block_n, 1, 1] `scale`, (u - 8) * scale, module docstring),
    then each word's four bytes joined in order, and the (nibble half, word) dimensions permuted into k
    order: k = 32 b + 16 h + 4 t + i."""
    v = f"tl.reshape({words}, [BLOCK_N, {depth} // {LANE_BLOCK}, 4])"
    if scale is None:
        halves = f"tl.join({v} & {MASK}, ({v} << 4) & {MASK})"
    else:
        u = f"({v} ^ {NIBBLE_SIGNS})"
        scaled = lambda n: f"(({n} & {LOW}) * {scale} + (128 - 8 * {scale}) * {ONES}) ^ {BYTE_SIGN}"  # noqa: E731
        halves = f"tl.join({scaled(f'({u} >> 4)')}, {scaled(u)})"
    return halves, (f"tl.reshape(tl.permute(tl.join(tl.join(h.to(tl.int8), (h >> 16).to(tl.int8)), "
                    f"tl.join((h >> 8).to(tl.int8), (h >> 24).to(tl.int8))), (0, 1, 3, 2, 4, 5)), [BLOCK_N, {depth}])")


def mma_lanes(t: Tile, lanes: tuple[E.Load, E.Load | None], segment: int) -> None:
    """The k loop of a `lanes` matrix tile, computed transposed; each k step is block_k / `segment`
    dots of `segment` k: with `operand_scale`, of lanes already times their group's scale, into the
    accumulator; otherwise a group's sum (or part of one) shifted and scaled into it, or per channel
    all of them into it directly."""
    em, con, top, body, kmask, acc = t.em, t.con, t.top, t.body, t.kmask, t.acc
    assert not em.row_pass, "gemm_w4a8 takes no fused norm"
    word, scale = lanes
    name = word.tensor
    scaled = bool(variant(t.schedule).option("operand_scale"))
    cmask = t.open_transposed("tl.int32")
    k_extent = em.emit(con.extent, body)
    for q in range(t.schedule["block_k"] // segment):
        body.line(f"kw{q} = k0 // 8 + {segment // 8 * q} + tl.arange(0, {segment // 8})[None, :]")
        bound = f"(kw{q} < {em.emit(em.op.tensors[name].shape[1], body)})" if kmask else None
        mask = " & ".join(m for m in (cmask, bound) if m)
        body.line(f"words{q} = tl.load({name}_ptr + c_t.to(tl.int64) * {name}_s0 + kw{q}"
                  + (f", mask={mask}, other=0)" if mask else ")"))
        group_scale = None
        if scale is not None:
            sg_scope = t.at_k(f"ksg{q}", f"k0 + {segment * q}", cmask, k_extent)
            group_scale = f"({em.emit(scale, sg_scope)}).to(tl.int32)"
        if scaled:
            body.line(f"sg{q} = tl.reshape({group_scale}, [BLOCK_N, 1, 1])")
        halves, join = _lanes(f"words{q}", str(segment), f"sg{q}" if scaled else None)
        body.line(f"h = {halves}")
        body.line(f"w{q} = {join}")
        body.line(f"kx{q} = k0 + {segment * q} + tl.arange(0, {segment})[:, None]")
        if kmask:
            body.line(f"kxm{q} = kx{q} < {k_extent}")
        x_scope = body.child(axes={"r": ("r_t", "rmask_t"), "k": (f"kx{q}", f"kxm{q}" if kmask else None)}, fresh=True)
        x = operand_tile(t, con.a, x_scope)
        if scale is None or scaled:
            body.line(f"{acc}_t = tl.dot(w{q}, {x}, {acc}_t, out_dtype=tl.int32)")
            continue
        body.line(f"seg = tl.dot(w{q}, {x}, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32), out_dtype=tl.int32)")
        body.line(f"{acc}_t += (seg >> {LANE_SHIFT}) * {group_scale}")
    top.line(f"{acc} = tl.trans({acc}_t)" + ("" if scale is not None else f" >> {LANE_SHIFT}"))
