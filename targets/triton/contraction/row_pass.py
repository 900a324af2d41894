"""A fused norm's row pass: the statements before the Contract (sums along k and values of them),
run over all of K before a matrix tile's k loop, or folded into a GEMV tile's (`in_loop`)."""
from __future__ import annotations

from flashgen.ir import expr as E
from flashgen.ir.op import Let, Reduce, Stmt
from flashgen.targets.triton.contraction.context import Tile
from flashgen.targets.triton.emit import Emitter, Scope

ROW_PASS_ELEMENTS = 4096  # x elements a row pass loads per step: [rows, k] tiles of at most this many


def row_pass(t: Tile, scope: Scope, rows: str, k_axis: int | None, suffix: str = "", summed: bool = False) -> None:
    """The row pass over all of K, after the wait for the previous kernel and before the k loop,
    `t.row_step` k at a time; or, `summed`, after a GEMV tile's k loop, which accumulated each sum's
    partial tile (`sum_in_loop`). `rows` is the row index: a scalar (`k_axis` None, a GEMV tile's
    row), [block_m, 1] (`k_axis` 1) or [1, block_m] (`k_axis` 0, the transposed int4 matrix tile).
    Each value is named `name + suffix`, and em.named maps the statement's name to it (a GEMV tile
    rebinds the names per row, `bind_row`)."""
    em, step = t.em, t.row_step
    k_extent = em.emit(t.con.extent, scope)
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


def bind_row(em: Emitter, i: int) -> None:
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


def sum_in_loop(em: Emitter, scope: Scope, i: int) -> None:
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
