"""The row plan (flashgen/ir/row_plan.py): which pass folds which reduction, where each store and
row-level value goes; both row backends walk it (their sources for every op were diffed unchanged when
it replaced their own copies of this logic)."""
from __future__ import annotations

import pytest

from flashgen.ir.expr import Dim, Index, Load, Param, Ref, rsqrt, where
from flashgen.ir.op import Let, Reduce, Store
from flashgen.ir.row_plan import Pass, RowLevel, RowPlan, row_plan
from flashgen.oplib import get_op

r, c, N = Index("r"), Index("c"), Dim("N")


def test_two_reductions_with_row_level_values_between():
    """A layernorm with side outputs: the mean is ready (and stored) after the first pass, the second
    pass folds the variance and makes the stores that need only the mean, a last pass the rest."""
    first = Store("first", (r,), Load("x", (r, 0)))  # one value per row, needing no reduction
    mean_out = Store("mean", (r,), Ref("mean"))
    centred = Store("centred", (r, c), Ref("xc"))
    rstd_out = Store("rstd", (r,), Ref("inv"))
    y = Store("y", (r, c), Ref("xc") * Ref("inv") * Load("w", (c,)))
    body = (Let("x", Load("x", (r, c))), Let("half_eps", Param("eps") * 0.5), first,
            Reduce("sum", "sum", Ref("x")), Let("mean", Ref("sum") / N), mean_out,
            Let("xc", Ref("x") - Ref("mean")), centred,
            Reduce("ssd", "sum", Ref("xc") * Ref("xc")), Let("inv", rsqrt(Ref("ssd") / N + Ref("half_eps"))),
            y, rstd_out)
    sum_, ssd = body[3], body[8]
    assert row_plan(body) == RowPlan(
        before=RowLevel(("half_eps",), (first,)),
        passes=(Pass(sum_, (), RowLevel(("mean",), (mean_out,))),
                Pass(ssd, (centred,), RowLevel(("inv",), (rstd_out,))),
                Pass(None, (y,), RowLevel())))


def test_a_store_counts_its_mask_and_indices():
    """A row value written at a column-varying index is made in a pass; a store whose mask needs a
    reduction waits for it, though its value needs none."""
    spread = Store("spread", (r, c), Ref("m"))  # the row's max broadcast over its columns
    masked = Store("keep", (r, c), Load("x", (r, c)), mask=Load("x", (r, c)) < Ref("m"))
    at_max = Store("pos", (r, Ref("m") * 0), Load("x", (r, 0)))  # an index that needs the reduction
    body = (Reduce("m", "max", Load("x", (r, c))), spread, masked, at_max)
    plan = row_plan(body)
    assert plan.before == RowLevel()
    assert plan.passes == (Pass(body[0], (), RowLevel((), (at_max,))), Pass(None, (spread, masked), RowLevel()))


def test_without_reductions_one_pass_stores():
    body = (Let("x", Load("x", (r, c))), Store("y", (r, c), where(Ref("x") < 0, 0.0, Ref("x"))))
    assert row_plan(body) == RowPlan(RowLevel(), (Pass(None, (body[1],), RowLevel()),))


def test_store_never_ready_is_an_error():
    body = (Reduce("s", "sum", Load("x", (r, c))), Store("y", (r, c), Ref("s") * Ref("typo")))
    with pytest.raises(ValueError, match="stores to y never become ready: typo is neither a Let nor a Reduce"):
        row_plan(body)


def test_reduction_needing_a_later_one_is_an_error():
    body = (Reduce("a", "sum", Load("x", (r, c)) * Ref("b")), Reduce("b", "max", Load("x", (r, c))),
            Store("y", (r,), Ref("a")))
    with pytest.raises(ValueError, match="reduction a needs b"):
        row_plan(body)


@pytest.mark.parametrize("op, attrs, passes", [
    ("rmsnorm", {}, [("ss", (), ()), (None, ("y",), ())]),
    ("layernorm", {}, [("sum", (), ()), ("ssd", (), ()), (None, ("y",), ())]),
    ("add_rmsnorm", {}, [("ss", ("residual_out",), ()), (None, ("y",), ())]),
    ("dynamic_quant", {"out_dtype": "int8"}, [("amax", (), ("scale",)), (None, ("q",), ())]),
])
def test_library_ops(op, attrs, passes):
    """The op library's: the new residual is stored while its squares are summed, a row's quant scale
    as soon as its largest magnitude is known."""
    plan = row_plan(get_op(op).body({"dtype": "bf16", **attrs}))
    assert [(p.reduce.name if p.reduce else None, tuple(s.tensor for s in p.stores),
             tuple(s.tensor for s in p.after.stores)) for p in plan.passes] == passes
