"""Mixture-of-experts routing: moe_route, the router's softmax and top-k over a token's expert logits.

Ranks are picked one at a time, each by two reductions over the row: the largest logit not yet chosen,
then the smallest column holding it. The k chosen are the first k of the order (logit descending,
column ascending), so ties go to the lowest expert index, on every backend and in the reference.
Selecting on the logits picks what the softmax's probabilities would (exp is monotone) without the
rounding that could tie two probabilities of distinct logits.
"""
from __future__ import annotations

from flashgen.lazy import lazy

torch = lazy("torch")

from flashgen.ir.expr import Binary, Dim, Expr, Load, Ref, exp, where
from flashgen.ir.op import DTYPE, Attrs, Let, Op, Reduce, Stmt, Store, TensorSpec
from flashgen.oplib._common import FLOAT_DTYPES, M, c, f64, r, randn

E, K = Dim("E"), Dim("K")
TOPK = ("2", "1", "4", "6", "8")  # Mixtral 2, Qwen1.5-MoE 4, DeepSeek-V2-Lite 6, Qwen3-MoE 8


def _route(a: Attrs) -> tuple[Stmt, ...]:
    """Rank j's candidates are the columns after rank j-1's pick in the order: a lower logit, or the
    same logit at a higher column; a pick is the lowest candidate column holding their largest logit."""
    x = Ref("x")
    out: list[Stmt] = [Let("x", Load("logits", (r, c)))]
    for j in range(int(a["topk"])):
        hit: Expr = where(Binary("eq", x, Ref(f"m{j}")), c, E)
        if j == 0:
            out.append(Reduce("m0", "max", x))
        else:
            m, i = Ref(f"m{j - 1}"), Ref(f"id{j - 1}")
            out += [Let(f"after{j}", where(Binary("gt", c, i), Binary("le", x, m), Binary("lt", x, m))),
                    Reduce(f"m{j}", "max", where(Ref(f"after{j}"), x, float("-inf")))]
            hit = where(Ref(f"after{j}"), hit, E)
        out += [Reduce(f"id{j}", "min", hit), Store("topk_ids", (r, j), Ref(f"id{j}")),
                Let(f"e{j}", exp(Ref(f"m{j}") - Ref("m0")))]
    picked = [Ref(f"e{j}") for j in range(int(a["topk"]))]
    if a["renorm"] == "yes":  # the k weights sum to 1: the softmax's denominator cancels
        out.append(Let("z", sum(picked[1:], picked[0])))
    else:
        out.append(Reduce("z", "sum", exp(x - Ref("m0"))))
    return (*out, *(Store("topk_weights", (r, j), e / Ref("z")) for j, e in enumerate(picked)))


def _route_ref(t, p, d, a) -> dict:
    """softmax in float64, then the k largest probabilities, ties to the lowest index (a stable sort
    keeps equal values in index order)."""
    prob = torch.softmax(f64(t["logits"]), dim=-1)
    w, ids = torch.sort(prob, dim=-1, descending=True, stable=True)
    w, ids = w[:, :d["K"]], ids[:, :d["K"]]
    if a["renorm"] == "yes":
        w = w / w.sum(-1, keepdim=True)
    return {"topk_ids": ids, "topk_weights": w}


def _check(d, a) -> str | None:
    if int(a["topk"]) > d["E"]:
        return f"topk={a['topk']} is more than the E={d['E']} experts"
    return None


MOE_ROUTE = Op(
    name="moe_route", kclass="rowwise",
    doc="topk_ids, topk_weights = top-k of softmax(logits) over the E experts (ties: lowest index), "
        "the weights renormalised to sum to 1 if renorm",
    dims=("M", "E", "K"), row_dims=("M",),
    inputs=(TensorSpec("logits", (M, E), DTYPE),),
    outputs=(TensorSpec("topk_ids", (M, K), "int32"), TensorSpec("topk_weights", (M, K), "fp32")),
    domain=(M, E),
    attrs={"dtype": FLOAT_DTYPES, "topk": TOPK, "scoring": ("softmax",), "renorm": ("yes", "no")},
    attr_dims={"K": "topk"},
    build=_route, reference=_route_ref, check_dims=_check,
    make_inputs=lambda d, a, g: {"logits": randn((d["M"], d["E"]), a["dtype"], g, 0.0, 2.0)},
)

OPS = (MOE_ROUTE,)
