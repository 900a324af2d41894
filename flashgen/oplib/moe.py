"""Mixture of experts: moe_route (a router's top-k) and the experts' grouped GEMMs over the routed pairs.

moe_route ranks are picked one at a time, each by two reductions over the row: the largest score not
yet chosen, then the smallest column holding it. The k chosen are the first k of the order (score
descending, column ascending), so ties go to the lowest expert index, on every backend and in the
reference. With softmax scoring the score is the logit itself: exp is monotone, so it picks what the
probabilities would, without the rounding that could tie two probabilities of distinct logits; top-k
of the softmax renormalised is also the softmax of the top-k logits (Mixtral's order), the
denominator cancelling. With sigmoid_bias scoring (DeepSeek-V3) the score is sigmoid(logit) plus a
per-expert bias that only steers the choice: a pick's weight is its sigmoid, without the bias.
Non-finite logits give what the reference gives, and ids always name an expert: a NaN score ranks
above every number (torch's sort order), and where softmax's largest logit is not finite (a NaN, +inf,
or every logit -inf) every probability is NaN, so the ids are 0..k-1 and the weights NaN. A NaN
router row thus reaches its token's expert output as NaN, never as a silently finite one.
"""
from __future__ import annotations

from flashgen.lazy import lazy

torch = lazy("torch")

from flashgen.ir import dtypes
from flashgen.ir.expr import Binary, Dim, Expr, Index, Load, Ref, absolute, exp, sigmoid, where
from flashgen.ir.op import DTYPE, Attrs, Contract, Let, Op, Reduce, Stmt, Store, TensorSpec
from flashgen.ir.prologue import int4_code
from flashgen.oplib._common import FLOAT_DTYPES, M, c, f64, quantize_ref, r, randn
from flashgen.oplib.gemm import int4_weight
from flashgen.quant import pack_int4, packed_words, quantize_rtn, quantize_w4a8

E, K = Dim("E"), Dim("K")
k = Index("k")
TOPK = ("2", "1", "4", "6", "8")  # Mixtral 2, Qwen1.5-MoE 4, DeepSeek-V2-Lite 6, Qwen3-MoE 8


def _route(a: Attrs) -> tuple[Stmt, ...]:
    """Rank j's candidates are the columns after rank j-1's pick in the order: a lower score, or the
    same score at a higher column; a pick is the lowest candidate column holding their largest score.
    `x`, the score ranked, has NaN raised to +inf, so the order is total, each rank has a pick, and
    every id is in [0, E). With sigmoid_bias a NaN also ranks above a +inf score (torch's sort order):
    its column is ranked less E. (x >= -inf is false for NaN only. It tests the loads a score is made
    of, not the score, which the test defines.) The sigmoid is named `s`: the weights' passes need it
    too, and the CPU kernel computes a named value that several passes need once a row."""
    logit, bias = Load("logits", (r, c)), Load("bias", (c,))
    sigmoid_scoring = a["scoring"] == "sigmoid_bias"
    topk = int(a["topk"])
    col: Expr
    if sigmoid_scoring:  # (a sigmoid is NaN of a NaN only; plus a bias, of a NaN bias too)
        number = Binary("and", logit >= float("-inf"), bias >= float("-inf"))
        out: list[Stmt] = [Let("s", sigmoid(logit)), Let("x", where(number, Ref("s") + bias, float("inf"))),
                           Let("col", where(number, c, c - E))]
        col = Ref("col")
    else:  # (a row holding a NaN gets ids 0..k-1 below: how its NaN ranks is not seen)
        out, col = [Let("x", where(logit >= float("-inf"), logit, float("inf")))], c
    x = Ref("x")
    for j in range(topk):
        hit: Expr = where(Binary("eq", x, Ref(f"m{j}")), col, E)
        if j == 0:
            out.append(Reduce("m0", "max", x))
        else:
            m, i = Ref(f"m{j - 1}"), Ref(f"id{j - 1}")
            out += [Let(f"after{j}", where(Binary("gt", col, i), Binary("le", x, m), Binary("lt", x, m))),
                    Reduce(f"m{j}", "max", where(Ref(f"after{j}"), x, float("-inf")))]
            hit = where(Ref(f"after{j}"), hit, E)
        out.append(Reduce(f"id{j}", "min", hit))
        if sigmoid_scoring:  # the pick's own sigmoid: the bias steered the choice only
            out.append(Reduce(f"e{j}", "sum", where(Binary("eq", col, Ref(f"id{j}")), Ref("s"), 0.0)))
        else:
            out.append(Let(f"e{j}", exp(Ref(f"m{j}") - Ref("m0"))))
    ids: list[Expr] = [Ref(f"id{j}") for j in range(topk)]
    picked: list[Expr] = [Ref(f"e{j}") for j in range(topk)]
    if sigmoid_scoring:
        ids = [where(i < 0, i + E, i) for i in ids]
    else:
        # softmax's probabilities are all NaN where the largest logit is not finite (a NaN, raised to
        # +inf here; +inf; all -inf): the reference's stable sort then gives ids 0..k-1, and NaN weights
        finite = absolute(Ref("m0")) < float("inf")
        ids = [where(finite, i, j) for j, i in enumerate(ids)]
        picked = [where(finite, e, float("nan")) for e in picked]
    out += [Store("topk_ids", (r, j), i) for j, i in enumerate(ids)]
    if a["renorm"] == "yes":  # the k weights sum to 1 (with softmax, its denominator cancels)
        out.append(Let("z", sum(picked[1:], picked[0])))
    elif sigmoid_scoring:
        return (*out, *(Store("topk_weights", (r, j), e) for j, e in enumerate(picked)))
    else:
        out.append(Reduce("z", "sum", exp(x - Ref("m0"))))
    return (*out, *(Store("topk_weights", (r, j), e / Ref("z")) for j, e in enumerate(picked)))


def _route_ref(t, p, d, a) -> dict:
    """softmax in float64 (or sigmoid plus bias in float32, as the kernels compute the score they
    compare), then the k largest, ties to the lowest index (a stable sort keeps equal values in index
    order)."""
    if a["scoring"] == "sigmoid_bias":
        score = torch.sigmoid(t["logits"].float()) + t["bias"].float()
        prob = torch.sigmoid(f64(t["logits"]))
    else:
        score = prob = torch.softmax(f64(t["logits"]), dim=-1)
    ids = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :d["K"]]
    w = torch.gather(prob, 1, ids)
    if a["renorm"] == "yes":
        w = w / w.sum(-1, keepdim=True)
    return {"topk_ids": ids, "topk_weights": w}


def _route_inputs(d, a, g) -> dict:
    t = {"logits": randn((d["M"], d["E"]), a["dtype"], g, 0.0, 2.0)}
    if a["scoring"] == "sigmoid_bias":  # a bias as large as the sigmoids' spread: it changes choices
        t["bias"] = torch.rand(d["E"], generator=g) * 0.5
    return t


def _check(d, a) -> str | None:
    if int(a["topk"]) > d["E"]:
        return f"topk={a['topk']} is more than the E={d['E']} experts"
    return None


MOE_ROUTE = Op(
    name="moe_route", kclass="rowwise",
    doc="topk_ids, topk_weights = top-k of softmax(logits) over the E experts (ties: lowest index), "
        "or of sigmoid(logits) + bias with the sigmoids as weights (sigmoid_bias); the weights "
        "renormalised to sum to 1 if renorm",
    dims=("M", "E", "K"), row_dims=("M",),
    inputs=(TensorSpec("logits", (M, E), DTYPE), TensorSpec("bias", (E,), "fp32", when=(("scoring", ("sigmoid_bias",)),))),
    outputs=(TensorSpec("topk_ids", (M, K), "int32"), TensorSpec("topk_weights", (M, K), "fp32")),
    domain=(M, E),
    attrs={"dtype": FLOAT_DTYPES, "topk": TOPK, "scoring": ("softmax", "sigmoid_bias"), "renorm": ("yes", "no")},
    attr_dims={"K": "topk"},
    build=_route, reference=_route_ref, check_dims=_check, make_inputs=_route_inputs,
)



# ---- moe_gemm_gate_up / moe_gemm_down: the experts' grouped GEMMs over the routed (token, expert) pairs ----
# A pair p = token * KT + j is token p // KT's j-th expert. A program serves one expert's block of
# pairs (Index("e") is its expert, Index("r") a pair) and reads only that expert's weights, so the
# weights of experts no pair chose are never read. A pair whose id is outside [0, E) is no expert's:
# every path skips it (gate_up leaves its row of h as it was, down adds nothing for it), so no weight is
# read past the last expert's. How programs find their pairs is the `routing`
# attr: "sorted" takes them listed expert by expert (`moe_align`: `sorted_pairs`, expert e's at
# [expert_offsets[e], expert_offsets[e + 1])), "ids" takes the router's [M, KT] `topk_ids` and each
# program picks its expert's pairs itself (decode: a few hundred pairs, no alignment step to launch).
# The `weights` attr is the experts' format. With 16-bit activations: 16-bit experts (half), int8 codes
# with per-row scales (w8a16), int4 codes with 16-bit scales in groups of 128 k (w4a16g128, computed as
# the dense gemm_w4a16 is: per group, codes times x summed in fp32, times the group's scale; the
# dequantized weight is never rounded to 16 bits, `_expert_weights`). With int8
# activations quantized per row (x_q, x_scale: a token's row, quantized once before any pair gathers
# it; h_q, h_scale: a pair's row of h), summed exactly in int32 and scaled after: int8 codes with
# per-row scales (w8a8), and 4-bit codes in pack_int4's layout whose int8 operand (u - 8) * w_group has
# an integer group scale per 128 k, times a per-row scale (w4a8g128, flashgen/quant.py quantize_w4a8).
N_, KT = Dim("N"), Dim("KT")
e_ = Index("e")
WEIGHTS = ("half", "w8a16", "w4a16g128", "w8a8", "w4a8g128")
INT8_ACTIVATIONS = ("w8a8", "w4a8g128")  # formats whose ops take int8 activations with per-row scales
HALF_ACTIVATIONS = tuple(w for w in WEIGHTS if w not in INT8_ACTIVATIONS)
INT4_WEIGHTS = ("w4a16g128", "w4a8g128")
INT4_GROUP = 128
IDS_SCAN = 128  # top-k ids an ids-routed kernel reads at a time (its generator's and cost model's unit)


def moe_align(topk_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, expert_offsets) of a [M, KT] top-k: the pairs ordered by expert (stable: by
    token within an expert) and where each expert's run starts, E + 1 int32 offsets. A pair whose id
    is outside [0, E) is no expert's: it sorts after expert E - 1's run (past expert_offsets[E]), so
    no kernel serves it."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    flat = torch.where((flat >= 0) & (flat < experts), flat, experts)
    order = torch.sort(flat, stable=True).indices.to(torch.int32)
    # counts by a scatter, not bincount (which reads the largest id on the host): no sync, so a decode
    # step holding it can be captured in a CUDA graph
    ends = torch.zeros(experts + 2, dtype=torch.int64, device=flat.device)
    ends.index_add_(0, flat + 1, torch.ones_like(flat))
    return order, torch.cumsum(ends[:-1], 0).to(torch.int32)


def _weight(a: Attrs, rows: Expr) -> Expr:
    """Expert e's weight at (row `rows`, k), dequantized in the prologue (for int8 activations: the
    int8 operand); a per-row scale applies to the accumulator instead (`_scaled`)."""
    w = a["weights"]
    if w in INT4_WEIGHTS:  # pack_int4's interleaved words, symmetric codes (zero point 8)
        return (int4_code("w_packed", (e_, rows)) - 8) * Load("scales" if w == "w4a16g128" else "w_group", (e_, rows, k // INT4_GROUP))
    return Load("w" if w == "half" else "w_q", (e_, rows, k))


def _scaled(a: Attrs, acc: Expr, rows: Expr, act_scale: Expr) -> Expr:
    """The accumulator times the weight's per-row scale and the activation row's scale, where the
    format has them."""
    if a["weights"] in INT8_ACTIVATIONS:
        return acc * act_scale * Load("w_scale", (e_, rows))
    return acc * Load("w_scale", (e_, rows)) if a["weights"] == "w8a16" else acc


def _contract(a: Attrs, name: str, act: str, act_row: Expr, rows: Expr) -> Contract:
    """acc[pair, column] over K: 16-bit operands summed in fp32, or int8 ones summed exactly in int32."""
    if a["weights"] in INT8_ACTIVATIONS:
        return Contract(name, Load(f"{act}_q", (act_row, k)), _weight(a, rows), K, "int8", "int32")
    return Contract(name, Load(act, (act_row, k)), _weight(a, rows), K, DTYPE)


def _activation_specs(name: str, rows: Expr) -> tuple[TensorSpec, ...]:
    """An activation input: 16-bit, or int8 with a per-row fp32 scale (`INT8_ACTIVATIONS`)."""
    return (TensorSpec(name, (rows, K), DTYPE, when=(("weights", HALF_ACTIVATIONS),)),
            TensorSpec(f"{name}_q", (rows, K), "int8", when=(("weights", INT8_ACTIVATIONS),)),
            TensorSpec(f"{name}_scale", (rows,), "fp32", when=(("weights", INT8_ACTIVATIONS),)))


def _weight_specs(rows: Expr) -> tuple[TensorSpec, ...]:
    return (TensorSpec("w", (E, rows, K), DTYPE, when=(("weights", ("half",)),)),
            TensorSpec("w_q", (E, rows, K), "int8", when=(("weights", ("w8a16", "w8a8")),)),
            TensorSpec("w_scale", (E, rows), "fp32", when=(("weights", ("w8a16", "w8a8", "w4a8g128")),)),
            TensorSpec("w_packed", (E, rows, packed_words(K)), "int32", when=(("weights", INT4_WEIGHTS),)),
            TensorSpec("scales", (E, rows, K // INT4_GROUP), DTYPE, when=(("weights", ("w4a16g128",)),)),
            TensorSpec("w_group", (E, rows, K // INT4_GROUP), "int8", when=(("weights", ("w4a8g128",)),)))


def _expert_weights(t: dict, a: Attrs) -> torch.Tensor:
    """The [E, rows, K] float64 weights the kernel computes with: int8 operands scaled after the sum
    (exact), int4 codes times their group scales as the dense int4 GEMMs take them (`int4_weight`:
    exact, never rounded to the 16-bit dtype; w4a8's integer operand then times its row's scale)."""
    w = a["weights"]
    if w == "half":
        return f64(t["w"])
    if w not in INT4_WEIGHTS:
        return f64(t["w_q"]) * f64(t["w_scale"])[..., None]
    group = t["scales" if w == "w4a16g128" else "w_group"]
    e, rows, groups = group.shape
    weight = int4_weight(t["w_packed"].reshape(e * rows, -1), group.reshape(e * rows, -1), groups * INT4_GROUP)
    weight = weight.reshape(e, rows, -1)
    return weight * f64(t["w_scale"])[..., None] if w == "w4a8g128" else weight


def _activations(t: dict, name: str, a: Attrs) -> torch.Tensor:
    """An activation input in float64: int8 rows times their scales (`INT8_ACTIVATIONS`)."""
    if a["weights"] in INT8_ACTIVATIONS:
        return f64(t[f"{name}_q"]) * f64(t[f"{name}_scale"])[:, None]
    return f64(t[name])


def _make_activations(t: dict, name: str, shape: tuple[int, int], a: Attrs, g: torch.Generator) -> None:
    """Random activations `name` [rows, K], int8 per row for `INT8_ACTIVATIONS` (as dynamic_quant makes them)."""
    if a["weights"] in INT8_ACTIVATIONS:
        q, scale = quantize_ref(torch.randn(shape, generator=g, dtype=torch.float64), "int8")
        t[f"{name}_q"], t[f"{name}_scale"] = q.to(torch.int8), scale.float()
    else:
        t[name] = randn(shape, a["dtype"], g)


def w4a8_expert(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One expert's [rows, K] weight in the w4a8g128 format (`quantize_w4a8` in groups of 128, codes in
    pack_int4's layout); K = 128, which quantize_w4a8 takes per channel, has group scales of 1."""
    qa = quantize_w4a8(w, INT4_GROUP)
    group = qa.group_scales
    if group is None:
        group = torch.ones(w.shape[0], w.shape[1] // INT4_GROUP, dtype=torch.int8, device=w.device)
    return {"w_packed": pack_int4(qa.codes), "w_group": group, "w_scale": qa.channel_scales}


def _make_weights(t: dict, shape: tuple[int, int, int], a: Attrs, g: torch.Generator) -> None:
    """Random expert weights of `shape` [E, rows, K] in the workload's format."""
    w = torch.randn(shape, generator=g) / shape[2] ** 0.5
    if a["weights"] == "half":
        t["w"] = w.to(dtypes.TORCH[a["dtype"]])
        return
    e, rows, k = shape
    if a["weights"] == "w4a8g128":
        t.update(w4a8_expert(w.reshape(e * rows, k)))
        t.update({name: v.reshape(e, rows, *v.shape[1:]) for name, v in t.items() if name.startswith("w_")})
        return
    bits, group = (8, None) if a["weights"] in ("w8a16", "w8a8") else (4, INT4_GROUP)
    q = quantize_rtn(w.reshape(e * rows, k), bits=bits, group=group)
    if bits == 8:
        t["w_q"], t["w_scale"] = q.codes.reshape(shape), q.scales[:, 0].reshape(e, rows).float()
    else:
        t["w_packed"] = pack_int4(q.codes).reshape(e, rows, -1)
        t["scales"] = q.scales.reshape(e, rows, -1).to(dtypes.TORCH[a["dtype"]])


def _routing(d, a, g) -> dict:
    """A random top-k of distinct experts per token (aligned, for the sorted routing); the first expert
    is left unchosen (its run is empty) when the others suffice, so kernels meet an expert with no pairs."""
    m, e, kt = d["M"], d["E"], d["KT"]
    skip = 1 if e - 1 >= kt else 0
    ids = torch.stack([torch.randperm(e - skip, generator=g)[:kt] + skip for _ in range(m)]).to(torch.int32)
    if a["routing"] == "ids":
        return {"topk_ids": ids.reshape(m, kt)}
    pairs, offsets = moe_align(ids, e)
    return {"sorted_pairs": pairs, "expert_offsets": offsets}


def expert_runs(sorted_pairs: torch.Tensor, expert_offsets: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """Each expert with pairs, and its pairs (as int64 indices), from `moe_align`'s ordering: the pairs
    of no expert (an id outside [0, E)) are in none. Reads the offsets on the host."""
    off, pairs = expert_offsets.tolist(), sorted_pairs.long()
    return [(e, pairs[off[e]:off[e + 1]]) for e in range(len(off) - 1) if off[e + 1] > off[e]]


def _pairs_of(t: dict, experts: int) -> list[tuple[int, torch.Tensor]]:
    return expert_runs(*(moe_align(t["topk_ids"], experts) if "topk_ids" in t else
                         (t["sorted_pairs"], t["expert_offsets"])))


def _moe_check(d, a) -> str | None:
    if d["KT"] > d["E"]:
        return f"topk={d['KT']} is more than the E={d['E']} experts"
    if a["weights"] in INT4_WEIGHTS and d["K"] % INT4_GROUP:
        return f"K={d['K']} is not a multiple of the int4 weights' group of {INT4_GROUP}"
    return None


ROUTING = (TensorSpec("sorted_pairs", (M * KT,), "int32", when=(("routing", ("sorted",)),)),
           TensorSpec("expert_offsets", (E + 1,), "int32", when=(("routing", ("sorted",)),)),
           TensorSpec("topk_ids", (M, KT), "int32", when=(("routing", ("ids",)),)))
MOE_ATTRS = {"dtype": ("bf16", "fp16"), "weights": WEIGHTS, "topk": TOPK, "routing": ("sorted", "ids")}


def _gate_up(a: Attrs) -> tuple[Stmt, ...]:
    """Both halves of a pair's gate_up row in one k loop (the x tile loaded once), SiLU(gate) * up."""
    x_scale = Load("x_scale", (r // KT,))
    gate = _scaled(a, Ref("gate"), c, x_scale)
    up = _scaled(a, Ref("up"), c + N_, x_scale)
    return (_contract(a, "gate", "x", r // KT, c), _contract(a, "up", "x", r // KT, c + N_),
            Store("h", (r, c), gate * sigmoid(gate) * up))


def _gate_up_ref(t, p, d, a) -> dict:
    w, x = _expert_weights(t, a), _activations(t, "x", a)
    # (the row of a pair of no expert stays 0 here; a kernel leaves it unwritten)
    h = torch.zeros(d["M"] * d["KT"], d["N"], dtype=torch.float64, device=x.device)
    for e, pairs in _pairs_of(t, d["E"]):
        y = x[pairs // d["KT"]] @ w[e].T
        gate, up = y[:, :d["N"]], y[:, d["N"]:]
        h[pairs] = gate * torch.sigmoid(gate) * up
    return {"h": h}


def _gate_up_inputs(d, a, g) -> dict:
    t = _routing(d, a, g)
    _make_activations(t, "x", (d["M"], d["K"]), a, g)
    _make_weights(t, (d["E"], 2 * d["N"], d["K"]), a, g)
    return t


MOE_GEMM_GATE_UP = Op(
    name="moe_gemm_gate_up", kclass="moe",
    doc="h[p] = silu(x[p // KT] @ w[e_p, :N].T) * (x[p // KT] @ w[e_p, N:].T) for each routed pair p "
        "(token p // KT's expert e_p), grouped by expert; w [E, 2N, K] (gate rows, then up rows); int8 "
        "formats (w8a8, w4a8g128) take x_q with a per-token x_scale, summed in int32",
    dims=("M", "N", "K", "E", "KT"), row_dims=("M",),
    inputs=(*_activation_specs("x", M), *ROUTING, *_weight_specs(2 * N_)),
    outputs=(TensorSpec("h", (M * KT, N_), DTYPE),),
    domain=(M * KT, N_), attrs=MOE_ATTRS, attr_dims={"KT": "topk"},
    build=_gate_up, reference=_gate_up_ref, check_dims=_moe_check, make_inputs=_gate_up_inputs,
)


def _down(a: Attrs) -> tuple[Stmt, ...]:
    """A pair's expert output, weighted by its router weight and added to its token's row of y."""
    out = _scaled(a, Ref("acc"), c, Load("h_scale", (r,))) * Load("topk_weights", (r,))
    return (_contract(a, "acc", "h", r, c), Store("y", (r // KT, c), out, combine="add"))


def _down_ref(t, p, d, a) -> dict:
    w, h = _expert_weights(t, a), _activations(t, "h", a)
    y = f64(t["y"]).clone()
    for e, pairs in _pairs_of(t, d["E"]):
        y.index_add_(0, pairs // d["KT"], (h[pairs] @ w[e].T) * f64(t["topk_weights"])[pairs, None])
    return {"y": y}


def _down_inputs(d, a, g) -> dict:
    p = d["M"] * d["KT"]
    t = {**_routing(d, a, g), "topk_weights": torch.rand(p, generator=g) + 0.05,
         "y": randn((d["M"], d["N"]), "fp32", g)}
    _make_activations(t, "h", (p, d["K"]), a, g)
    _make_weights(t, (d["E"], d["N"], d["K"]), a, g)
    return t


MOE_GEMM_DOWN = Op(
    name="moe_gemm_down", kclass="moe",
    doc="y[p // KT] += topk_weights[p] * (h[p] @ w[e_p].T) for each routed pair p, grouped by expert: "
        "each token's k expert outputs, weighted, summed into y [M, N] (fp32, in place); int8 formats "
        "(w8a8, w4a8g128) take h_q with a per-pair h_scale, summed in int32",
    dims=("M", "N", "K", "E", "KT"), row_dims=("M",),
    # (h follows the inputs every format has: where it is int8, h_q and h_scale stand in its place)
    inputs=(TensorSpec("topk_weights", (M * KT,), "fp32"), TensorSpec("y", (M, N_), "fp32", written=True),
            *_activation_specs("h", M * KT), *ROUTING, *_weight_specs(N_)),
    outputs=(),
    domain=(M * KT, N_), attrs=MOE_ATTRS, attr_dims={"KT": "topk"},
    build=_down, reference=_down_ref, check_dims=_moe_check, make_inputs=_down_inputs,
)

OPS = (MOE_ROUTE, MOE_GEMM_GATE_UP, MOE_GEMM_DOWN)
