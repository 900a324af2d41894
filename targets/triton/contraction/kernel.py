"""The contraction kernel: the tile walk, the k range of a split, the k loop's form, the epilogue."""
from __future__ import annotations

from dataclasses import replace

from flashgen.ir import expr as E
from flashgen.ir import prologue
from flashgen.ir.contraction import MMA_MIN_ROWS, int4_affine, int8_lanes, lane_segment, operand_dtype, tma_operands
from flashgen.ir.op import Contract, Let, Store, eval_int
from flashgen.ir.variants import count, variant
from flashgen.quant import INT4_PERIOD
from flashgen.targets.triton.contraction.context import ACC, Tile
from flashgen.targets.triton.contraction.gemv import gemv
from flashgen.targets.triton.contraction.int4_gemv import segment_runs
from flashgen.targets.triton.contraction.int4_mma import mma_int4
from flashgen.targets.triton.contraction.int8_lanes import mma_lanes
from flashgen.targets.triton.contraction.mma import k_loop, tma_k_loop
from flashgen.targets.triton.contraction.ptx import UNPACK_FLOAT
from flashgen.targets.triton.contraction.row_pass import prologue_refs, row_factors, row_pass, row_pass_step
from flashgen.targets.triton.contraction.split_k import merge_splits, split_scratch
from flashgen.targets.triton.emit import (Emitter, KernelSource, Scope, grid_dependency, kernel_args,
                                          module_header)
from flashgen.workload import Schedule, Workload


def tile_order(top: Scope, ns: str = "tl") -> None:
    """Tile pid's row and column tiles (`pid_m`, `pid_n`), `group_m` row tiles at a time along the
    grid's one axis, so that programs running together share weight tiles in the L2; `ns` is the
    language module's name in the generated source."""
    top.line("group = pid // (GROUP_M * tiles_n)")
    top.line("first_m = group * GROUP_M")
    top.line(f"size_m = {ns}.minimum(tiles_m - first_m, GROUP_M)")
    top.line("pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m")
    top.line("pid_n = (pid % (GROUP_M * tiles_n)) // size_m")


def _tile_walk(top: Scope, rows: str, cols: str, cmask: str | None) -> None:
    """Tile pid's row and column tiles (`tile_order`), and its rows and columns."""
    tile_order(top)
    top.line("r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]")
    top.line(f"rmask = r < {rows}")
    top.line("c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]")
    if cmask:
        top.line(f"cmask = c < {cols}")


def _k_range(top: Scope, k_extent: str, split_k: int) -> None:
    """`k_lo`, `k_hi`: the program's share of K, whole k steps, the last share shorter."""
    if split_k > 1:
        top.line("split = tl.program_id(2)")
        top.line(f"k_span = tl.cdiv(tl.cdiv({k_extent}, SPLIT_K), BLOCK_K) * BLOCK_K")
        top.line("k_lo = split * k_span")
        top.line(f"k_hi = tl.minimum({k_extent}, k_lo + k_span)")
    else:
        top.line("k_lo = 0")
        top.line(f"k_hi = {k_extent}")


def generate_contraction(wl: Workload, s: Schedule) -> KernelSource:
    """A contraction workload's Triton kernel for schedule `s` (one launch: a weight dequantized
    first is two kernels, targets/staged.py)."""
    assert not variant(s).option("dequant_first"), "a weight dequantized first is two kernels (targets/staged.py)"
    op, attrs = wl.op, wl.attr
    body = op.body(attrs)
    lets = {st.name: st.value for st in body if isinstance(st, Let)}
    [con] = [st for st in body if isinstance(st, Contract)]
    epilogue = body[body.index(con) + 1:]
    m_extent, n_extent = op.domain
    em = Emitter(op, attrs, lets)
    em.row_pass = body[:body.index(con)]
    name = f"{op.name}_kernel"
    split_k = count(s, "split_k")
    consts = {"BLOCK_M": s["block_m"], "BLOCK_N": s["block_n"], "BLOCK_K": s["block_k"], "GROUP_M": count(s, "group_m"),
              "SPLIT_K": split_k}
    scratch = split_scratch(s["block_m"], s["block_n"], split_k, con.acc) if split_k > 1 else ()
    args = kernel_args(wl, consts, scratch)
    lines = module_header(wl, s, name, args)
    n_val, k_val = eval_int(n_extent, wl.dim), eval_int(con.extent, wl.dim)
    cmask = "cmask" if n_val % s["block_n"] else None
    kmask = k_val % s["block_k"] != 0
    persistent = count(s, "persistent")
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
    _tile_walk(top, rows, cols, cmask)
    acc = f"acc_{con.name}"
    top.line(f"{acc} = tl.zeros([BLOCK_M, BLOCK_N], dtype={ACC[con.acc]})")
    _k_range(top, em.emit(con.extent, top), split_k)
    if not persistent and not variant(s).option("early_load"):
        grid_dependency(top)
    b_scope = top.child(top.indent + "    ", {"c": ("c", cmask), "k": ("kb", "kmask_b" if kmask else None),
                                            "k0": ("k0", None)}, fresh=True)
    unpacked: dict[E.Load, str] = {}
    grouped: dict[E.Load, str] = {}
    b_expr = prologue.rewrite(con.b, wl.dim, s["block_k"], unpacked, grouped)
    affine = int4_affine(wl) if s["block_k"] % INT4_PERIOD == 0 else None
    operand = operand_dtype(wl)
    gemv_tile = s["block_m"] < MMA_MIN_ROWS
    if em.row_pass and gemv_tile and split_k == 1:
        # An unsplit GEMV tile loads every x of its rows: the row pass's sums accumulate along with the
        # products, and its values scale each row's sum at the end, so nothing waits before the k loop.
        rest, factors = row_factors(con.a, {st.name for st in em.row_pass})
        if factors and not prologue_refs(rest, em.row_pass):
            con, em.row_factors = replace(con, a=rest), factors
    t = Tile(em, con, lets, s, top, b_scope, kmask, acc, operand, b_expr, affine,
             segment_runs(affine, wl.dim, s["block_k"]) if affine else 0,
             row_pass_step(k_val, 1 if gemv_tile else s["block_m"]), unpacked, grouped)
    int4_mma = affine and operand in UNPACK_FLOAT
    if em.row_pass and not gemv_tile:
        if int4_mma:  # the transposed int4 tile reads x^T: rows along dim 1
            top.line("r_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]")
            row_pass(t, top, "r_p", 0)
        else:
            row_pass(t, top, "r", 1)
    if gemv_tile:
        gemv(t)
    elif int4_mma:
        mma_int4(t)
    elif variant(s).option("lanes"):
        mma_lanes(t, int8_lanes(wl), lane_segment(wl, s["block_k"]))
    elif variant(s).option("tma"):
        tma_k_loop(t, tma_operands(wl))
    else:
        k_loop(t)
    em.named[con.name] = acc
    out = merge_splits(top, acc, con.acc) if split_k > 1 else top
    for st in epilogue:
        if isinstance(st, Store):
            em.store(st, out)
    head = lines.index("@triton.jit")  # the helpers go before the kernel
    lines[head:head] = [line for src in t.helpers.values() for line in (*src.splitlines(), "", "")]
    return KernelSource(name, em.finish(lines), args, (s["block_m"], s["block_n"]), tile_cols=True, flat=True,
                        grid_z=split_k, scratch=scratch, persistent=persistent)
