"""The plan of a row kernel's walks over a row, read by every backend that walks a row in column tiles.

A rowwise op's reductions each need the whole row, so a row too long for one tile is walked once per
reduction (a pass), in body order, and once more for the stores that need every reduction. Values are
either column-varying (vectors: they depend on the column index, through the Lets they name) or one
per row (row-level). A column-varying store is made in the earliest pass by which every reduction it
needs is done; a row-level Let or store is computed between passes, as soon as the reductions it
needs are done. A store counts as column-varying and needs what its value, mask and indices need.

The plan is computed once from the op's body, so the backends (Triton's tile loops, TVM's column
loops) differ only in the code each writes for a step, never in which step a statement belongs to. (A
row-level Let is a value, not an effect: a backend may compute it later, where a step first uses it, as
TVM's does.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from flashgen.ir import expr as E
from flashgen.ir.op import Let, Reduce, Stmt, Store, depends_on_cols, refs


@dataclass(frozen=True)
class RowLevel:
    """Row-level work that becomes ready at one point of the walk: Lets (by name, in body order) of one
    value per row, then the stores of such values."""
    lets: tuple[str, ...] = ()
    stores: tuple[Store, ...] = ()


@dataclass(frozen=True)
class Pass:
    """One walk over the row's column tiles: it folds `reduce` (None for a last walk that only
    stores) and makes `stores`, the column-varying stores ready before it; `after` is the row-level
    work that the reduction's value makes ready."""
    reduce: Reduce | None
    stores: tuple[Store, ...]
    after: RowLevel


@dataclass(frozen=True)
class RowPlan:
    """`before`: row-level work that needs no reduction; then the passes, one per reduction in body
    order, and a last one only where column-varying stores need every reduction."""
    before: RowLevel
    passes: tuple[Pass, ...]


def needs(e: E.Expr | None, lets: Mapping[str, E.Expr]) -> set[str]:
    """The reductions (and any names no Let defines) a value needs, through the Lets it names."""
    out: set[str] = set()
    if e is None:
        return out
    for name in refs(e):
        out |= needs(lets[name], lets) if name in lets else {name}
    return out


def store_needs(st: Store, lets: Mapping[str, E.Expr]) -> set[str]:
    """What a store needs: its value's, its mask's and its indices' reductions."""
    out = needs(st.value, lets) | needs(st.mask, lets)
    for ix in st.indices:
        out |= needs(ix, lets)
    return out


def store_varies(st: Store, lets: Mapping[str, E.Expr]) -> bool:
    """Whether a store writes a different element per column (its value, mask or an index varies)."""
    return any(x is not None and depends_on_cols(x, lets) for x in (st.value, st.mask, *st.indices))


def row_plan(body: Sequence[Stmt]) -> RowPlan:
    """The passes over a row for `body` (Lets, Reduces and Stores); a ValueError names a reduction that
    needs a later one and stores that never become ready (they name a value nothing defines)."""
    lets = {st.name: st.value for st in body if isinstance(st, Let)}
    reduces = [st for st in body if isinstance(st, Reduce)]
    pending = [st for st in body if isinstance(st, Store)]
    done: set[str] = set()
    placed: set[str] = set()

    def row_level() -> RowLevel:
        ready_lets = tuple(name for name, value in lets.items() if name not in placed
                           and not depends_on_cols(value, lets) and needs(value, lets) <= done)
        placed.update(ready_lets)
        ready = tuple(st for st in pending if not store_varies(st, lets) and store_needs(st, lets) <= done)
        for st in ready:
            pending.remove(st)
        return RowLevel(ready_lets, ready)

    before = row_level()
    passes: list[Pass] = []
    for red in [*reduces, None]:
        now = tuple(st for st in pending if store_varies(st, lets) and store_needs(st, lets) <= done)
        if red is None and not now:
            break
        for st in now:
            pending.remove(st)
        if red is not None:
            if not needs(red.value, lets) <= done:
                later = sorted(needs(red.value, lets) - done)
                raise ValueError(f"reduction {red.name} needs {', '.join(later)}, not done before it")
            done.add(red.name)
        passes.append(Pass(red, now, row_level() if red is not None else RowLevel()))
    if pending:
        missing = sorted(set().union(*(store_needs(st, lets) for st in pending)) - done)
        raise ValueError(f"stores to {', '.join(st.tensor for st in pending)} never become ready: "
                         f"{', '.join(missing)} is neither a Let nor a Reduce")
    return RowPlan(before, tuple(passes))
