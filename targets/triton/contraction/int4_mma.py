"""Matrix tiles of int4 codes, computed transposed so that the unpacked weight is the matrix
instruction's register operand: shared memory holds packed words, never a dequantized tile."""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir import prologue
from flashgen.ir.variants import variant
from flashgen.quant import INT4_PERIOD
from flashgen.targets.triton.contraction import ptx
from flashgen.targets.triton.contraction.context import Tile
from flashgen.targets.triton.contraction.operands import RUN, operand_tile


def _joined(tiles: list[str]) -> str:
    """Tiles of 16 k (code positions j, j+1, ...) as one [block_n, 16 * n] tile in k order: joined in
    a tree (each join appends a dimension held in registers: the last one is the position's highest
    bit), the position's bits moved before the 16 words, highest first, and reshaped. Triton's layouts
    make all of it a renaming of registers into the matrix instruction's operand layout."""
    if len(tiles) == 1:
        return tiles[0]

    def tree(ts: list[str]) -> str:
        return ts[0] if len(ts) == 1 else f"tl.join({tree(ts[:len(ts) // 2])}, {tree(ts[len(ts) // 2:])})"

    bits = len(tiles).bit_length() - 1
    order = (0, *range(bits + 1, 1, -1), 1)
    return f"tl.reshape(tl.permute({tree(tiles)}, {order}), [BLOCK_N, {RUN * len(tiles)}])"


def _code_tile(t: Tile, words: str, scale: str, j: int) -> str:
    """Code j of the words less 8 in the operand dtype: as 16-bit floats (`ptx.UNPACK_FLOAT`) in PTX
    pairs (times the scale with `operand_scale`) or per element under the float's exponent, then
    converted where the operand is e4m3."""
    s = t.schedule
    if variant(s).option("operand_scale"):
        return f"{ptx.codes(t, j, scaled=True)}({words}, {scale})"
    unpack = ptx.UNPACK_FLOAT[t.operand]
    if variant(s).option("ptx_unpack"):
        code = f"{ptx.codes(t, j)}({words})"
    else:
        magic, base = ptx.INT4_MAGIC[unpack]
        shifted = words if j == 0 else f"({words} >> {4 * j})"
        code = f"((({shifted} & 15) | {magic}).to(tl.int16).to({dtypes.TL[unpack]}, bitcast=True) - {base + 8.0})"
    return code if unpack == t.operand else f"{code}.to({dtypes.TL[t.operand]})"


def mma_int4(t: Tile) -> None:
    """The k loop of a matrix tile of int4 codes `(code - zero) * scale`, computed transposed:
    acc^T [block_n, block_m] = W x^T, so that the weight is the instruction's A operand, which Hopper's
    warpgroup MMA reads from registers. Each k step loads [block_n, 16] words per 128 k; code j of
    those words is a run of 16 consecutive k. A code costs an AND-OR with a 16-bit float's exponent
    (1024 or 128 + code, exact) and a paired subtraction of 1032 or 136; the runs of a dot are joined
    into one operand tile (`_joined`) without moving data. Dots span the runs sharing a group (up to
    128 k) and sum per segment before the segment's scale; a zero point other than 8 adds (8 - zero)
    times the segment's sum of x."""
    em, con, top, body, s, kmask, acc = t.em, t.con, t.top, t.body, t.schedule, t.kmask, t.acc
    word, zero, scale = t.affine
    name = word.tensor
    cmask = t.open_transposed("tl.float32")
    k_extent = em.emit(con.extent, body)
    offset = None if zero == E.Const(8) else zero
    oscale = bool(variant(s).option("operand_scale"))  # the scale multiplies the operand: no second accumulator
    direct = oscale or not prologue.segment_sums(t.affine)
    per_segment = t.per_segment
    per_dot = min(per_segment, 8) & -min(per_segment, 8)  # runs per dot: a power of two within one block
    for q in range(0, s["block_k"] // RUN, per_dot):
        b, j = divmod(q, 8)
        if j == 0:
            body.line(f"kw{b} = k0 // 8 + {RUN * b} + tl.arange(0, {RUN})[None, :]")
            bound = f"(kw{b} < {em.emit(em.op.tensors[name].shape[1], body)})" if kmask else None
            mask = " & ".join(m for m in (cmask, bound) if m)
            body.line(f"words{b} = tl.load({name}_ptr + c_t.to(tl.int64) * {name}_s0 + kw{b}"
                      + (f", mask={mask}, other=0)" if mask else ")"))
        body.line(f"kx{q} = k0 + {RUN * q} + tl.arange(0, {RUN * per_dot})[:, None]")
        if kmask:
            body.line(f"kxm{q} = kx{q} < {k_extent}")
        x_scope = body.child(axes={"r": ("r_t", "rmask_t"), "k": (f"kx{q}", f"kxm{q}" if kmask else None)}, fresh=True)
        x = operand_tile(t, con.a, x_scope)
        if oscale and j == 0:  # one scale per row and block of 128 k (the rules ask for groups of 128 k or more)
            sc_scope = t.at_k(f"ksc{b}", f"k0 + {INT4_PERIOD * b}", cmask, k_extent)
            body.line(f"sc{b} = tl.broadcast_to(({em.emit(scale, sc_scope)}).to({dtypes.TL[t.operand]}), [BLOCK_N, {RUN}])")
        runs = []
        for jj in range(j, j + per_dot):
            body.line(f"c{jj} = {_code_tile(t, f'words{b}', f'sc{b}', jj)}")
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
            seg_scope = t.at_k(f"kseg{first}", f"k0 + {RUN * first}", cmask, k_extent)
            value = "seg" if offset is None else f"(seg + (8.0 - {em.emit(offset, seg_scope)}) * xs)"
            body.line(f"{acc}_t += {value}" + (f" * {em.emit(scale, seg_scope)}" if scale is not None else ""))
    top.line(f"{acc} = tl.trans({acc}_t)")
