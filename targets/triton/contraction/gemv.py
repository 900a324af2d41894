"""Tiles of fewer rows than a matrix instruction takes: products summed on the ALUs."""
from __future__ import annotations

from flashgen.ir.op import Reduce
from flashgen.ir.variants import variant
from flashgen.targets.triton.contraction.context import ACC, Tile
from flashgen.targets.triton.contraction.int4_gemv import int4_terms, magic_register, pair_terms, quad_terms
from flashgen.targets.triton.contraction.operands import b_tile_values, load_words
from flashgen.targets.triton.contraction.row_pass import bind_row, row_pass, sum_in_loop
from flashgen.targets.triton.emit import Scope, grid_dependency


def weighted_sum(t: Tile, scope: Scope, segments: list, row: tuple[str, str | None], in_loop: int | None = None,
                 loaded: dict[tuple[str, str], str] | None = None) -> str:
    """One row's products of x with a k step's weight terms (`int4_terms`' segments, or one segment of a
    weight tile), summed per segment times its scale: the expression to add to the row's partial sums.
    `row` is the row's (index, mask) axis; `in_loop`, the row's number when its row-pass sums
    accumulate over the x loaded here (`sum_in_loop`); `loaded`, the x this k step loaded by (row, k),
    which Contracts over the same x (the moe class's gate and up) share."""
    em, acc_t = t.em, ACC[t.con.acc]
    loaded = {} if loaded is None else loaded
    sums = []
    for scale, terms in segments:
        products = []
        for k, kmask_k, w, factor in terms:
            if (row[0], k) not in loaded:
                x_scope = scope.child(axes={"r": row, "k": (k, kmask_k)}, fresh=True)
                loaded[row[0], k] = em.emit(t.con.a, x_scope)
                if in_loop is not None:
                    sum_in_loop(em, x_scope, in_loop)
            x = loaded[row[0], k]
            products.append(f"{x}.to({acc_t})" + (f" * {factor}" if factor != 1.0 else "") + f" * {w}")
        sums.append(f"({' + '.join(products)}) * {scale}" if scale else " + ".join(products))
    return " + ".join(sums)


def _products(t: Tile, scope: Scope, segments: list, in_loop: bool) -> None:
    """Each row's products of x with the step's weight terms (`weighted_sum`), added to the row's
    partial sums."""
    rows = t.em.emit(t.em.op.domain[0], t.top)
    for i in range(t.schedule["block_m"]):
        scope.line(f"rmask{i} = r{i} < {rows}")
        bind_row(t.em, i)
        scope.line(f"part{i} += " + weighted_sum(t, scope, segments, (f"r{i}", f"rmask{i}"), i if in_loop else None))


def gemv(t: Tile) -> None:
    """The k loop of a tile of fewer rows than a matrix instruction takes, on the ALUs: the weight
    tile is multiplied, in the layout it was loaded in, by a column of x per row, into a tile of
    partial sums per row that is summed over k only after the loop. No operand layout, no
    shared-memory round trip, one FMA per weight and row; int4 codes take `int4_terms`' route when
    their zero point and scale allow it (`pair_terms`' or `quad_terms`' with `ptx_unpack`). With
    `early_load`, the first k step's weights (which no kernel writes) are loaded before the wait for
    the previous kernel (`grid_dependency`), so that a GEMV's first DRAM round trip overlaps the kernel
    before it; only x and what follows wait. An unsplit tile sums its row pass's reductions in the k
    loop, over the x it loads (`sum_in_loop`), and scales each row's sum by the factors taken out of
    the prologue (`row_factors`) after it; a split tile runs the row pass per row after the wait."""
    em, top, s, affine = t.em, t.top, t.schedule, t.affine
    rows = em.emit(em.op.domain[0], top)
    acc_t = ACC[t.con.acc]
    block_m = s["block_m"]
    for i in range(block_m):
        top.line(f"r{i} = pid_m * BLOCK_M + {i}")
        per = (" // 32" if variant(s).option("ptx_unpack") == 2 else " // 8") if affine else ""
        top.line(f"part{i} = tl.zeros([BLOCK_K{per}, BLOCK_N], dtype={acc_t})")
    if affine and not variant(s).option("ptx_unpack"):
        magic_register(top, rows)

    in_loop = bool(em.row_factors)  # the row pass's sums accumulate in the k loop, over x it loads anyway
    for i in range(block_m) if in_loop else ():
        for st in em.row_pass:
            if isinstance(st, Reduce):
                top.line(f"{st.name}_part_r{i} = tl.zeros([BLOCK_K{' // 8' if affine else ''}, 1], dtype=tl.float32)")

    def row_passes(scope: Scope) -> None:
        for i in range(block_m) if not in_loop else ():
            row_pass(t, scope, f"r{i}", None, f"_r{i}")

    if not variant(s).option("early_load"):
        row_passes(top)

    def k_step(scope: Scope, before_x: bool = False) -> None:
        """One k step at k0: the weight terms, then (after the wait when `before_x`) x and the products."""
        if affine and variant(s).option("ptx_unpack"):
            words = load_words(t, scope, affine[0])
            if before_x:
                grid_dependency(scope)
                row_passes(scope)
            (quad_terms if variant(s).option("ptx_unpack") == 2 else pair_terms)(t, words, scope)
            return
        if affine:
            segments = int4_terms(t, scope)
        else:
            b_tile_values(t, scope)
            w = em.temp(scope, f"{em.emit(t.b_expr, scope)}.to({acc_t})")
            segments = [(None, [("kb", "kmask_b" if t.kmask else None, w, 1.0)])]
        if before_x:
            grid_dependency(scope)
            row_passes(scope)
        _products(t, scope, segments, in_loop)

    first = "k_lo"
    if variant(s).option("early_load"):  # the first k step, peeled: its weights before the wait (k_lo < k_hi: no splits)
        top.line("k0 = k_lo")
        k_step(t.body.child(top.indent, fresh=True), before_x=True)
        first = "k_lo + BLOCK_K"
    # Loads that feed no matrix instruction are software-pipelined only when the loop asks.
    top.line(f"for k0 in tl.range({first}, k_hi, BLOCK_K, num_stages={s['num_stages']}):")
    k_step(t.body)
    top.line("row_ids = tl.arange(0, BLOCK_M)[:, None]")
    for i in range(block_m):
        scaled = ""
        if in_loop:  # the row pass's values from the summed parts, then the factors taken out of x
            row_pass(t, top, f"r{i}", None, f"_r{i}", summed=True)
            scaled = "".join(f" * {em.emit(f, top.child(fresh=True))}" for f in em.row_factors)
        top.line(f"{t.acc} = tl.where(row_ids == {i}, (tl.sum(part{i}, axis=0){scaled})[None, :], {t.acc})")
