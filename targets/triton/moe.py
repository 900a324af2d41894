"""Triton code generation for the moe class: grouped GEMMs over the (token, expert) pairs a router chose.

The pairs come ordered expert by expert (`sorted_pairs`, with each expert's run in `expert_offsets`:
flashgen/oplib/moe.py's `moe_align`). A program serves block_m consecutive pairs of one expert and
block_n output columns: it reads only its expert's weight tiles, so an expert no pair chose costs no
bytes, and in decode (a few pairs per expert) each touched expert's weights are read once per column
tile. Programs are numbered along the first grid axis over every expert's row tiles in turn; there
are at most P / block_m + E of them (each expert's last tile may be partial), so no host-side count is
needed: each program finds its expert from the offsets' running tile counts, and one past the last
tile returns at once. With the ids routing (decode) there is no alignment step: program (pid_m, pid_n,
e) scans the router's top-k ids for expert e's pairs and serves the pid_m-th block of them (an expert
has at most M pairs, one a token), returning at once where there is none. A pair whose id is outside
[0, E) is no expert's, on either routing: no program serves it (h's row is left as it was, y gets
nothing from it), so no weight is read past the last expert's. The k loop loads the A
tile through the op's prologue (gathered rows: a pair's token row of x), the weight tiles of each
Contract (dequantized as the IR says), and accumulates `tl.dot` in fp32 (int32 for int8 activations
and weights); Contracts over the same A share its tile (gate and up in one loop). Tiles of fewer than
16 pairs sum on the ALUs instead (`_alu_k_loop`): decode's one or two pairs per expert. int4 codes
entering a 16-bit float operand (w4a16g128) compute as the dense int4 GEMMs do, codes times x summed
per group before the group's scale: the dense GEMV's terms in ALU tiles, a dot of the codes scaled
after in matrix tiles. The epilogue is the op's statements: a `combine="add"` store adds atomically (a
token's k expert outputs meet there).
"""
from __future__ import annotations

from flashgen.ir import prologue
from flashgen.ir.contraction import MMA_MIN_ROWS, contract_int4_affine
from flashgen.ir.expr import Dim
from flashgen.ir.op import Contract, Let, Store, eval_int
from flashgen.oplib.moe import IDS_SCAN
from flashgen.targets.triton.contraction.context import ACC, Tile
from flashgen.targets.triton.contraction.gemv import weighted_sum
from flashgen.targets.triton.contraction.int4_gemv import int4_terms, magic_register, segment_runs
from flashgen.targets.triton.contraction.operands import unpacked_values
from flashgen.targets.triton.emit import Emitter, KernelSource, Scope, grid_dependency, kernel_args, module_header
from flashgen.workload import Schedule, Workload


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _expert_of_tile(top: Scope) -> None:
    """`e`, the expert whose row tiles hold program pid_m (E when none does), and in its scope `j`,
    the program's positions in `sorted_pairs`, `rmask` those inside the expert's run."""
    top.line("ee = tl.arange(0, E_PAD)")
    top.line("lo = tl.load(expert_offsets_ptr + ee, mask=ee < E, other=0)")
    top.line("hi = tl.load(expert_offsets_ptr + ee + 1, mask=ee < E, other=0)")
    top.line("tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M")
    top.line("ends = tl.cumsum(tiles, 0)")
    top.line("e = tl.sum((ends <= pid_m).to(tl.int32), 0)")


def _pairs_from_ids(top: Scope) -> None:
    """The ids routing: the row axis holds slots of M / block_m row blocks each; a slot is an expert,
    or, when the pairs are fewer than the experts (decode on many experts), a pair, standing for its
    expert if it is that expert's first pair (so only experts with pairs launch programs). Program
    (pid_m, pid_n) takes the block of expert e's pairs its row block names, found by scanning the
    top-k ids SCAN at a time: each match's rank among e's pairs is a running count, and `r` gathers
    the pairs whose ranks the program's rows ask for. `cnt`: the expert's pairs in all; `lead`:
    whether this program's slot serves e: never where e, a pair's id, is outside [0, E) (no expert's
    pair: its weights would be read past the last expert's)."""
    top.line("blocks = (M + BLOCK_M - 1) // BLOCK_M")
    top.line("slot = pid_m // blocks")
    top.line("pid_m = pid_m % blocks")
    top.line("by_pair = M * KT < E")
    top.line("first_id = tl.load(topk_ids_ptr + (slot // KT).to(tl.int64) * topk_ids_s0 + slot % KT)")
    top.line("e = tl.where(by_pair, first_id, slot)")
    top.line("jj = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
    top.line("r = tl.zeros([BLOCK_M, 1], dtype=tl.int32)")
    top.line("cnt = pid_m * 0")
    top.line("first = cnt + M * KT")
    top.line("for p0 in range(0, M * KT, SCAN):")
    top.line("    p = p0 + tl.arange(0, SCAN)")
    top.line("    ids = tl.load(topk_ids_ptr + (p // KT).to(tl.int64) * topk_ids_s0 + p % KT, mask=p < M * KT, other=-1)")
    top.line("    mine = (ids == e).to(tl.int32)")
    top.line("    rank = cnt + tl.cumsum(mine, 0) - 1")
    top.line("    r += tl.sum(tl.where((mine[None, :] == 1) & (rank[None, :] == jj), p[None, :], 0), 1)[:, None]")
    top.line("    first = tl.minimum(first, tl.min(tl.where(mine == 1, p, M * KT), 0))")
    top.line("    cnt += tl.sum(mine, 0)")
    top.line("lead = ((first == slot) | (M * KT >= E)) & (e >= 0) & (e < E)")
    top.line("rmask = jj < cnt")


def _weight_tiles(em: Emitter, wl: Workload, s: Schedule, top: Scope, body: Scope, contracts: list[Contract],
                  accs: dict[str, str], kmask: bool) -> dict[str, Tile]:
    """Each Contract's k step as the contraction class's Tile, whose helpers make its weight prologue
    tile-shaped (flashgen/ir/prologue.py): int4 codes, where the k step holds whole blocks of them,
    loaded as [block_k / 8, block_n] words once and unpacked by shifts in registers; a group scale
    loaded once per group (a row of the tile, or the step's one row). The rewrite's names are shared,
    so that gate's and up's rows of one weight get names of their own. A Tile's `affine` holds int4
    codes entering a 16-bit float operand (`contract_int4_affine`), which both k loops scale per group
    after summing codes times x, as the dense int4 tiles do."""
    unpacked: dict = {}
    grouped: dict = {}
    tiles = {}
    for con in contracts:
        affine = contract_int4_affine(con, em.attrs, wl.dim)
        tiles[con.name] = Tile(em, con, em.lets, s, top, body, kmask, accs[con.name], con.operand_dtype(em.attrs),
                               prologue.rewrite(con.b, wl.dim, s["block_k"], unpacked, grouped), affine,
                               segment_runs(affine, wl.dim, s["block_k"]) if affine else 0, 0, unpacked, grouped)
    return tiles


def _mma_k_loop(em: Emitter, wl: Workload, s: Schedule, blk: Scope, contracts: list[Contract],
                accs: dict[str, str], cmask: str | None, kmask: bool) -> None:
    """The k loop of a tile of block_m >= 16 pairs: A and weight tiles cast to the operand dtype, one
    `tl.dot` per Contract into its fp32 (int32 for int8 operands) accumulator; int4 codes unpacked
    from their words tile (`unpacked_values`). int4 codes entering a 16-bit float operand are dotted as
    codes less the zero point (exact in it) and the step's group scale multiplies the dot, as the dense
    `mma_int4` scales each segment (the rules give such tiles k steps within one group)."""
    blk.line(f"for k0 in range(0, {em.emit(contracts[0].extent, blk)}, BLOCK_K):")
    loop = blk.child(blk.indent + "    ", {}, fresh=True)
    loop.line("ka = k0 + tl.arange(0, BLOCK_K)[None, :]")
    loop.line("kb = k0 + tl.arange(0, BLOCK_K)[:, None]")
    if kmask:
        k_extent = em.emit(contracts[0].extent, loop)
        loop.line(f"kmask_a = ka < {k_extent}")
        loop.line(f"kmask_b = kb < {k_extent}")
    e_axis = ("e", None)
    a_scope = loop.child(axes={"r": ("r", "rmask"), "k": ("ka", "kmask_a" if kmask else None), "e": e_axis},
                         fresh=True)
    b_scope = loop.child(axes={"c": ("c", cmask), "k": ("kb", "kmask_b" if kmask else None), "e": e_axis,
                               "k0": ("k0", None)}, fresh=True)
    tiles = _weight_tiles(em, wl, s, blk, b_scope, contracts, accs, kmask)
    unpacked_values(tiles[contracts[0].name], b_scope)  # (every Contract's: the rewrite's names are shared)
    for con in contracts:
        operand, acc = con.operand_dtype(em.attrs), accs[con.name]
        a = em.operand(con.a, a_scope, operand)
        b_expr, scale = tiles[con.name].b_expr, None
        if tiles[con.name].affine is not None and tiles[con.name].affine[2] is not None:
            b_expr, scale = b_expr.a, em.emit(b_expr.b, b_scope)  # codes less the zero point; the step's scale row
        b = em.operand(b_expr, b_scope, operand)
        if scale is None:
            loop.line(f"{acc} = tl.dot({a}, {b}, {acc}, out_dtype={ACC[con.acc]})")
        else:
            loop.line(f"{acc} += tl.dot({a}, {b}, out_dtype={ACC[con.acc]}) * {scale}")


def _alu_k_loop(em: Emitter, wl: Workload, s: Schedule, blk: Scope, contracts: list[Contract],
                accs: dict[str, str], cmask: str | None, kmask: bool) -> None:
    """The k loop of a tile of fewer pairs than a matrix instruction takes (decode: one or a few pairs
    per expert), on the ALUs, as the contraction class's GEMV tiles: each step's weight tile
    [block_k, block_n] is dequantized once (int8 codes, and int4 codes of an integer operand unpacked
    from their words tile, `unpacked_values`) and multiplied, in the layout it was loaded in, by each
    pair's column of activations, into a tile of partial sums per pair, summed over k once after the
    loop; int4 codes entering a 16-bit float operand take the dense GEMV's `int4_terms` instead (three
    instructions a code, the words never reshaped, the group scale once per segment sum; the rules
    give them k steps of whole blocks of 128). No operand layout for a 16-row instruction of which one
    row is used, no shared-memory round trip; deep k steps keep kilobytes of weights in flight
    (`tl.range` pipelines the plain loads)."""
    bm = s["block_m"]
    blk.line("row_ids = tl.arange(0, BLOCK_M)[:, None]")
    loop = blk.child(blk.indent + "    ", {}, fresh=True)
    b_scope = loop.child(axes={"c": ("c", cmask), "k": ("kb", "kmask_b" if kmask else None), "e": ("e", None),
                               "k0": ("k0", None)}, fresh=True)
    tiles = _weight_tiles(em, wl, s, blk, b_scope, contracts, accs, kmask)
    codes = tiles[contracts[0].name].affine is not None  # (one weight format: every Contract's or none's)
    for i in range(bm):  # each pair of the tile as scalars: its index and whether it is served
        blk.line(f"r{i} = tl.sum(tl.where(row_ids == {i}, r, 0))")
        blk.line(f"rmask{i} = tl.sum(tl.where(row_ids == {i}, rmask.to(tl.int32), 0)) > 0")
        for con in contracts:
            blk.line(f"part{i}_{con.name} = tl.zeros([BLOCK_K{' // 8' if codes else ''}, BLOCK_N], dtype={ACC[con.acc]})")
    if codes:
        magic_register(blk, em.emit(Dim(em.op.row_dims[0]), blk))  # (M: LLVM folds (M * KT) >> 31 to 0)
    blk.line(f"for k0 in tl.range(0, {em.emit(contracts[0].extent, blk)}, BLOCK_K, num_stages={s['num_stages']}):")
    if codes:  # the dense GEMV's terms: eight [block_k / 8, block_n] tiles of codes, scaled per segment
        loaded: dict = {}  # (x at each code position, loaded once for every Contract)
        for con in contracts:
            segments = int4_terms(tiles[con.name], b_scope)
            for i in range(bm):
                loop.line(f"part{i}_{con.name} += "
                          + weighted_sum(tiles[con.name], loop, segments, (f"r{i}", f"rmask{i}"), loaded=loaded))
    else:
        loop.line("kb = k0 + tl.arange(0, BLOCK_K)[:, None]")
        if kmask:
            loop.line(f"kmask_b = kb < {em.emit(contracts[0].extent, loop)}")
        unpacked_values(tiles[contracts[0].name], b_scope)  # (every Contract's: the rewrite's names are shared)
        for con in contracts:
            operand, acc_t = con.operand_dtype(em.attrs), ACC[con.acc]
            w = em.temp(loop, f"{em.operand(tiles[con.name].b_expr, b_scope, operand)}.to({acc_t})")
            for i in range(bm):
                row = loop.child(axes={"r": (f"r{i}", f"rmask{i}"), "k": b_scope.axes["k"]}, fresh=True)
                loop.line(f"part{i}_{con.name} += {em.operand(con.a, row, operand)}.to({acc_t}) * {w}")
    for i in range(bm):
        for con in contracts:
            acc = accs[con.name]
            blk.line(f"{acc} = tl.where(row_ids == {i}, tl.sum(part{i}_{con.name}, axis=0)[None, :], {acc})")


def generate_moe(wl: Workload, s: Schedule) -> KernelSource:
    """A moe workload's Triton kernel for schedule `s`."""
    op, attrs = wl.op, wl.attr
    body = op.body(attrs)
    lets = {st.name: st.value for st in body if isinstance(st, Let)}
    contracts = [st for st in body if isinstance(st, Contract)]
    em = Emitter(op, attrs, lets)
    name = f"{op.name}_kernel"
    by_ids = "topk_ids" in {t.name for t in wl.inputs}
    consts = {"BLOCK_M": s["block_m"], "BLOCK_N": s["block_n"], "BLOCK_K": s["block_k"],
              **({"SCAN": IDS_SCAN} if by_ids else {"E_PAD": _next_pow2(wl.dim["E"])})}
    args = kernel_args(wl, consts)
    lines = module_header(wl, s, name, args)
    n_val, k_val = eval_int(op.domain[1], wl.dim), eval_int(contracts[0].extent, wl.dim)
    cmask = "cmask" if n_val % s["block_n"] else None
    kmask = k_val % s["block_k"] != 0
    top = Scope(lines, "    ", {})
    top.line("pid_m = tl.program_id(0)")
    top.line("pid_n = tl.program_id(1)")
    grid_dependency(top)
    if by_ids:
        _pairs_from_ids(top)
        top.line("if (pid_m * BLOCK_M < cnt) & lead:")
        blk = top.child(top.indent + "    ")
    else:
        _expert_of_tile(top)
        top.line("if e < E:")
        blk = top.child(top.indent + "    ")
        blk.line("mine = ee == e")
        blk.line("j = tl.sum(tl.where(mine, lo + (pid_m - ends + tiles) * BLOCK_M, 0), 0) + tl.arange(0, BLOCK_M)[:, None]")
        blk.line("rmask = j < tl.sum(tl.where(mine, hi, 0), 0)")
        blk.line("r = tl.load(sorted_pairs_ptr + j, mask=rmask, other=0)")
    blk.line("c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
    if cmask:
        blk.line(f"cmask = c < {em.emit(op.domain[1], blk)}")
    accs = {con.name: f"acc_{con.name}" for con in contracts}
    for con in contracts:
        blk.line(f"{accs[con.name]} = tl.zeros([BLOCK_M, BLOCK_N], dtype={ACC[con.acc]})")
    k_loop = _alu_k_loop if s["block_m"] < MMA_MIN_ROWS else _mma_k_loop
    k_loop(em, wl, s, blk, contracts, accs, cmask, kmask)
    em.named.update(accs)
    out_cmask = cmask
    if out_cmask is None and s["block_m"] < MMA_MIN_ROWS:
        # a one-pair tile's [1, 1] row mask, which Triton's interpreter does not broadcast over an
        # atomic add's columns (it adds the first only): an ALU tile's epilogue gets the output's shape
        blk.line(f"cmask_out = c < {em.emit(op.domain[1], blk)}")
        out_cmask = "cmask_out"
    out = blk.child(axes={"r": ("r", "rmask"), "c": ("c", out_cmask), "e": ("e", None)}, fresh=True)
    for st in body:
        if isinstance(st, Store):
            em.store(st, out)
    if by_ids:  # an expert has at most M pairs (one a token): M / block_m row blocks of each slot
        kt = wl.dim["KT"]
        return KernelSource(name, em.finish(lines), args, (s["block_m"] * kt, s["block_n"]), tile_cols=True,
                            slots="E")
    # a tile of pid_m's rows, and (with `seq_tiles`) one more per expert: each expert's last may be partial
    return KernelSource(name, em.finish(lines), args, (s["block_m"], s["block_n"]), tile_cols=True, seq_tiles="E")
