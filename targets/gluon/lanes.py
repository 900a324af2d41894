"""gemm_w4a8's `lanes` codes in Gluon, for Hopper: int8 warpgroup MMAs whose register operand is the
unpacked weight, fed by a copy warp, so that the MMA warps unpack a k step's codes while the MMAs of
its previous chunk run.

The tile is computed transposed, acc^T [block_n, block_m] = W x^T, as the int4 tiles are (int4.py,
whose copy warp, rings, tile place and split K it shares): block_n weight rows on the MMA's 64-row
side, block_m activation rows on its narrow side. A ring slot holds a k step's packed words as bytes
(block_k / 2 a row, never an unpacked tile) and its int8 activations.

Why no reshuffle is needed: in the `lanes` layout (flashgen/quant.py) a 32-k block is four words, word
t holding k = 4t + i in the high nibbles of its bytes and k = 16 + 4t + i in the low ones. Loaded as a
[block_n, 32] byte tile (two blocks) in the layout of an int8 MMA's register operand, a thread's four
registers of a 16-row slice (rows g and g + 8, bytes 4t.. and 16 + 4t..) are word t of the first
block and of the second block for both rows; the operand of the first block's MMA is those of the
first block, high nibbles for k 4t.. and low ones for 16 + 4t.. (rows g and g + 8), and likewise the
second's. One inline-PTX statement (`_lanes_pair`, pack = 16: the four registers) writes both
operands; per four codes it takes the lanes (an AND, after a shift for the high ones, with each
nibble's sign bit flipped: the code u), u * s + 128 - 8 s on four lanes in one IMAD, and the top bit
of each byte flipped: (u - 8) * s exactly, s the group's integer scale (1 per channel), as in
targets/triton/contraction/int8_lanes.py.
"""
from __future__ import annotations

from flashgen.ir.contraction import gluon_lane_operands, lane_segment
from flashgen.ir.variants import count
from flashgen.quant import LANE_BLOCK
from flashgen.targets.gluon.emit import NS
from flashgen.targets.gluon.int4 import (load_steps, mma_partition, part_k, parts, partitions, rings, tile_place,
                                         transposed_epilogue)
from flashgen.targets.gluon.tile import Tile, start
from flashgen.targets.triton.contraction.split_k import split_scratch
from flashgen.targets.triton.emit import KernelSource, Scope
from flashgen.workload import Schedule, Workload

CHUNK = 2 * LANE_BLOCK  # k of one byte tile: two blocks, two MMAs
MMA_K = LANE_BLOCK  # k of one int8 warpgroup MMA


def _pair_asm() -> str:
    """Inline PTX for the operands of two 32-k blocks' MMAs ($0-$3 the first's registers a0-a3,
    $4-$7 the second's) from the four registers of their byte tile ($8-$11: word t of the first block
    in rows g and g + 8, then of the second) and the blocks' scales ($12-$15 and $16-$19, a row's
    scale in each byte: rows g and g + 8 in the first two)."""
    lines = [".reg .b32 s, c, u;"]

    def lanes(out: int, word: int, scale: int, high: bool) -> None:
        src = f"${word}"
        if high:
            lines.append(f"shr.b32 u, {src}, 4;")
            src = "u"
        lines.append(f"lop3.b32 u, {src}, 0x0F0F0F0F, 0x08080808, 0x6A;")  # (w & low nibbles) ^ sign: u
        lines.append(f"and.b32 s, ${scale}, 0xFF;")
        lines.append("mad.lo.u32 c, s, 0xF7F7F7F8, 0x80808080;")  # 128 - 8 s in each byte
        lines.append("mad.lo.u32 u, u, s, c;")  # u * s + 128 - 8 s in [0, 240]: no carry
        lines.append(f"xor.b32 ${out}, u, 0x80808080;")  # (u - 8) * s as int8

    for block, (word, scale) in enumerate(((8, 12), (10, 16))):
        for row in (0, 1):
            lanes(4 * block + row, word + row, scale + row, high=True)  # k 4t.. of rows g, g + 8
            lanes(4 * block + 2 + row, word + row, scale + row, high=False)  # k 16 + 4t..
    return "{ " + " ".join(lines) + " }"


def _helpers() -> list[str]:
    """The @gluon.jit function of `_pair_asm`."""
    constraints = ",".join(["=r"] * 8 + ["r"] * 12)
    return ["@gluon.jit", "def _lanes_pair(tile, scale_a, scale_b):",
            f'    return {NS}.inline_asm_elementwise("{_pair_asm()}", "{constraints}", [tile, scale_a, scale_b], '
            f"dtype=({NS}.int8, {NS}.int8), is_pure=True, pack=16)", "", ""]


def generate_lanes(wl: Workload, s: Schedule) -> KernelSource:
    """A gemm_w4a8 workload's Gluon kernel for schedule `s` (sm_90; schedules/contraction_space.py
    `gluon_invalid` says which schedules it takes)."""
    split_k = count(s, "split_k")
    scratch = split_scratch(s["block_m"], s["block_n"], split_k, "int32") if split_k > 1 else ()
    consts = {"BLOCK_M": s["block_m"], "BLOCK_N": s["block_n"], "BLOCK_K": s["block_k"], "GROUP_M": count(s, "group_m"),
              "STAGES": s["num_stages"], **({"SPLIT_K": split_k} if split_k > 1 else {})}
    t = start(wl, s, consts, scratch)
    tile_place(t)
    x, word, _ = gluon_lane_operands(wl)
    rings(t, x, word.tensor, byte_view=True)
    ring = ["x_ring", "w_ring", "ready", "free", "pid", "off_m", "off_n", "k_lo", "k_hi", "k_steps",
            *(["split"] if split_k > 1 else [])]
    helpers = _helpers() + load_steps(parts(t), 2) + _mma_steps(t, ring)
    partitions(t, ring)
    return KernelSource(t.name, t.module(helpers), t.args, (s["block_m"], s["block_n"]), tile_cols=True,
                        flat=True, grid_z=split_k, scratch=scratch, dialect="gluon")


def _scale_span(t: Tile) -> int:
    """The k one scale tile covers within a k step: a group, or the whole step (groups as deep or
    deeper, or per channel)."""
    return lane_segment(t.wl, t.s["block_k"])


def _scales(t: Tile, scope: Scope, k: str, name: str, sc_mask: str | None) -> None:
    """The k step at `k`'s scale tiles `{name}0`, `{name}1`, ... as [block_n, 1] int8 (ones per
    channel), each at the step's k of its span, clamped to the program's last k (a span past K, where
    the copies read zeros, loads a real group)."""
    scale = gluon_lane_operands(t.wl)[2]
    for i in range(t.s["block_k"] // _scale_span(t)):
        if scale is None:
            scope.line(f"{name}{i} = {NS}.full([BLOCK_N, 1], 1, {NS}.int8, layout=w_operand)")
            continue
        scope.line(f"k_{name}{i} = {NS}.minimum({k} + {i * _scale_span(t)}, k_hi - 1)")
        sc = scope.child(axes={"c": ("c_t", sc_mask), "k": (f"k_{name}{i}", None)}, fresh=True)
        scope.line(f"{name}{i} = ({t.em.emit(scale, sc)}).to({NS}.int8)")


def _mma_steps(t: Tile, ring: list[str]) -> list[str]:
    """The MMA warps' partition: per k step and 64-k chunk, the byte tile loaded into the MMA
    operand's registers, both blocks' operands unpacked (`_lanes_pair`) and their MMAs issued while
    the next chunk unpacks; then the op's epilogue (after the splits' merge, where K is split)."""
    lines, mma = mma_partition(t, ring, "unpack each chunk's bytes into two MMAs' register operands while the "
                               "last ones run", MMA_K, 4, "int32")
    mma.line(f"c_t = off_n + {NS}.arange(0, BLOCK_N, layout={NS}.SliceLayout(1, w_operand))[:, None]")
    sc_mask = None
    if t.cmask:
        mma.line(f"cmask_t = c_t < {t.cols}")
        sc_mask = "cmask_t"
    _scales(t, mma, "k_lo", "sc", sc_mask)
    mma.line("for ki in range(k_steps):")
    _k_step(t, mma.child(mma.indent + "    "), sc_mask)
    transposed_epilogue(t, mma, "int32")
    return lines + ["", ""]


def _k_step(t: Tile, step: Scope, sc_mask: str | None) -> None:
    """One k step: the next step's scales loaded, its slot awaited, each chunk unpacked and its two
    MMAs issued; the slot handed back once every MMA of the step is done (their register operands are
    held until then)."""
    chunks, span, pk, np_ = t.s["block_k"] // CHUNK, _scale_span(t), part_k(t), parts(t)
    step.line("s = ki % STAGES")
    if gluon_lane_operands(t.wl)[2] is not None:
        step.line(f"k_next = {NS}.minimum(k_lo + (ki + 1) * BLOCK_K, k_hi - 1)")
        _scales(t, step, "k_next", "sn", sc_mask)
    step.line("mbarrier.wait(ready.index(s), (ki // STAGES) & 1)")
    for p in range(chunks):
        k0, k1 = p * CHUNK, p * CHUNK + MMA_K
        step.line(f"b{p} = w_ring.index(s).slice({p * CHUNK // 2}, {CHUNK // 2}, dim=1).load(w_operand)")
        step.line(f"_, sa{p} = {NS}.broadcast(b{p}, sc{k0 // span})")
        step.line(f"_, sb{p} = {NS}.broadcast(b{p}, sc{k1 // span})")
        step.line(f"wa{p}, wb{p} = _lanes_pair(b{p}, sa{p}, sb{p})")
        for name, kk in ((f"wa{p}", k0), (f"wb{p}", k1)):
            part, col = divmod(kk, pk)
            step.line(f"acc_t = warpgroup_mma({name}, x_ring.index(s * {np_} + {part}).slice({col}, {MMA_K}, dim=1)"
                      f".permute((1, 0)), acc_t, is_async=True)")
    # (Triton 3.6 keeps no int8 operand alive through the wait: ptxas holds a warpgroup MMA's register
    # operands until the wait_group retiring it)
    step.line("acc_t = warpgroup_mma_wait(0, deps=[acc_t])")
    step.line("mbarrier.arrive(free.index(s))")
    if gluon_lane_operands(t.wl)[2] is not None:
        for i in range(t.s["block_k"] // span):
            step.line(f"sc{i} = sn{i}")
