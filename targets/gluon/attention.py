"""The attention class's prefill in Gluon, for Hopper: a producer warp copying the query tile and a
ring of key/value tiles by TMA, one or two consumer warpgroups of WARPGROUP_ROWS x WARPGROUP query
rows each, attending to every key tile of the ring with asynchronous warpgroup MMAs.

One program serves block_m = 64 x consumers queries of one sequence and query head, numbered as the
Triton kernel numbers them (targets/triton/attention.py `_sequence_of_tile`, longest causal tiles
first). Key tiles stop at the diagonal. A consumer's loop is software-pipelined: at step j it issues
the logits of key tile j (S = Q K^T) and the weighted values of tile j - 1 (O += P V, its
probabilities in registers as the MMA's A operand) back to back, then runs tile j's online softmax
while both run; a ring slot goes back to the copy warp once its values' MMA is done. With `pingpong`
the two consumers take turns issuing those MMAs (a turn barrier each), so one's softmax overlaps the
other's MMAs and the tensor cores never wait for both at once. Masks apply only on the key tiles that
reach the diagonal (and on every tile, under a mask other than the plain causal one); the op's score
expression (softcap, alibi) is emitted from the IR as in the Triton kernel.
"""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.ir.contraction import WARPGROUP, WARPGROUP_ROWS
from flashgen.ir.op import Attend
from flashgen.targets.gluon.contraction import CONSUMER_REGS, PRODUCER_REGS
from flashgen.targets.gluon.emit import NS, GluonEmitter, grid_dependency, module_header, to_gluon
from flashgen.targets.triton.attention import CAUSAL, _logit, _sequence_of_tile
from flashgen.targets.triton.emit import KernelSource, Scope, kernel_args
from flashgen.workload import Schedule, Workload

ROWS = WARPGROUP * WARPGROUP_ROWS  # query rows of one consumer warpgroup (a warpgroup MMA's M)
SEQ_LAYOUT = f"{NS}.BlockedLayout([1], [32], [{WARPGROUP}], [0])"  # the sequence starts read at once

_LOAD_KV = ["@gluon.jit",
            "def _load_kv(q_desc, k_desc, v_desc, q_tile, k_ring, v_ring, q_ready, ready, free, s0, h, kvh, m0, n_tiles,",
            "             BLOCK_N: gl.constexpr, STAGES: gl.constexpr):",
            "    # the copy warp: the query tile once, then each key/value tile into a slot the consumers handed back",
            "    mbarrier.expect(q_ready, q_desc.block_type.nbytes)",
            "    tma.async_copy_global_to_shared(q_desc, [s0 + m0, h, 0], q_ready, q_tile)",
            "    for j in range(n_tiles):",
            "        s = j % STAGES",
            "        mbarrier.wait(free.index(s), ((j // STAGES) & 1) ^ 1)",
            "        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)",
            "        tma.async_copy_global_to_shared(k_desc, [s0 + j * BLOCK_N, kvh, 0], ready.index(s), k_ring.index(s))",
            "        tma.async_copy_global_to_shared(v_desc, [s0 + j * BLOCK_N, kvh, 0], ready.index(s), v_ring.index(s))",
            "", ""]


def _slot(ring: str, slot: str, transpose: bool = False) -> str:
    """A ring slot as the [BLOCK_N, D] operand of an MMA (its copy's box is [BLOCK_N, 1, D])."""
    view = f"{ring}.index({slot}).reshape([BLOCK_N, D])"
    return view + ".permute((1, 0))" if transpose else view


def _logits_mma(slot: str) -> str:
    return (f"sc = warpgroup_mma(q, {_slot('k_ring', slot, True)}, gl.zeros([{ROWS}, BLOCK_N], gl.float32, "
            "s_layout), use_acc=False, is_async=True)")


def _values_mma(slot: str) -> str:
    return f"acc = warpgroup_mma(pa, {_slot('v_ring', slot)}, acc, is_async=True)"


def _softmax(em: GluonEmitter, att: Attend, scope: Scope, kpos0: str, dt: str) -> None:
    """Key tile `kpos0`'s online-softmax step on its raw logits `sc`: the op's score, its mask where
    the tile reaches the diagonal (every tile under another mask), the running max, sum and `alpha`,
    the rescaling of the values before; `pa`, the probabilities as the next values MMA's A operand."""
    step = scope.child(fresh=True)
    step.line(f"kpos = {kpos0} + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))[None, :]")
    step.line("jmask = kpos < n")
    factor = _logit(em, att, step, "sc", None)
    if att.mask == CAUSAL:
        step.line(f"if {kpos0} + BLOCK_N > r0:  # keys past some of the rows")
        masked = step.child(step.indent + "    ")
    else:
        masked = step
    masked.line(f"logit = gl.where(jmask & ({em.emit(att.mask, masked)}), logit, float(\"-inf\"))")
    step.line(f"m_new = gl.maximum(m_i, gl.max(logit, axis=1){factor})")
    step.line("m_safe = gl.where(m_new == float(\"-inf\"), 0.0, m_new)  # no key seen yet: nothing to rescale")
    step.line("alpha = gl.exp2(m_i - m_safe)")
    step.line(f"p = gl.exp2(logit{factor} - m_safe[:, None])")
    step.line("l_i = l_i * alpha + gl.sum(p, axis=1)")
    step.line("m_i = m_new")
    step.line(f"pa = gl.convert_layout(p.to({dt}), p_layout)")


def _attend_rows(em: GluonEmitter, att: Attend, params: list[str], pingpong: bool, dt: str) -> list[str]:
    """A consumer warpgroup: rows [r0, r0 + ROWS) of the program's query tile against every key tile."""
    lines = ["@gluon.jit",
             f"def _attend_rows({', '.join(params)}, q_tile, k_ring, v_ring, q_ready, ready, free, "
             f"{'turn, ' if pingpong else ''}s0, n, h, m0, n_tiles, first):",
             "    # a consumer warpgroup: its query rows' logits and weighted values, tile after tile of keys",
             "    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], "
             f"instr_shape=[{WARPGROUP_ROWS}, BLOCK_N, 16])",
             "    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], "
             f"instr_shape=[{WARPGROUP_ROWS}, D, 16])",
             "    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)",
             f"    q = q_tile.reshape([BLOCK_M, D]).slice(first * {ROWS}, {ROWS})",
             f"    r0 = m0 + first * {ROWS}",
             f"    qpos = r0 + gl.arange(0, {ROWS}, layout=gl.SliceLayout(1, s_layout))[:, None]",
             f"    m_i = gl.full([{ROWS}], float(\"-inf\"), gl.float32, gl.SliceLayout(1, s_layout))",
             f"    l_i = gl.zeros([{ROWS}], gl.float32, gl.SliceLayout(1, s_layout))",
             f"    acc = gl.zeros([{ROWS}, D], gl.float32, o_layout)",
             "    scale = 1.0 / gl.sqrt(D * 1.0)",
             "    mbarrier.wait(q_ready, 0)",
             "    mbarrier.wait(ready.index(0), 0)",
             f"    {_logits_mma('0')}",
             "    sc = warpgroup_mma_wait(0, deps=[sc])"]
    top = Scope(lines, "    ", {"h": ("h", None), "qpos": ("qpos", None), "kpos": ("kpos", "jmask")})
    _softmax(em, att, top, "0", dt)
    top.line("for j in range(1, n_tiles):")
    body = top.child("        ")
    body.line("slot = j % STAGES")
    body.line("prev = (j - 1) % STAGES")
    body.line("mbarrier.wait(ready.index(slot), (j // STAGES) & 1)")
    if pingpong:
        body.line("mbarrier.wait(turn.index(first), ((j - 1) & 1) ^ (1 - first))  # the other's MMAs are issued")
    body.line(_logits_mma("slot"))
    body.line(_values_mma("prev") + "  # tile j - 1's, rescaled")
    if pingpong:
        body.line("mbarrier.arrive(turn.index(1 - first))  # its turn: this softmax overlaps its MMAs")
    body.line("sc = warpgroup_mma_wait(1, deps=[sc])  # the logits; the values' MMA runs on")
    _softmax(em, att, body, "j * BLOCK_N", dt)
    body.line("acc = warpgroup_mma_wait(0, deps=[acc])")
    body.line("mbarrier.arrive(free.index(prev))  # hand that slot back")
    body.line("acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]")
    top.line("last = (n_tiles - 1) % STAGES")
    top.line(_values_mma("last"))
    top.line("acc = warpgroup_mma_wait(0, deps=[acc])")
    top.line("mbarrier.arrive(free.index(last))")
    top.line("l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))")
    top.line("out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]")
    top.line(f"r = r0 + gl.arange(0, {ROWS}, layout=gl.SliceLayout(1, o_layout))[:, None]")
    top.line("dd = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))[None, :]")
    top.line(f"gl.store(out_ptr + (s0 + r).to(gl.int64) * out_s0 + h * out_s1 + dd, out.to({dt}), "
             "mask=(r >= 0) & (r < n))")
    return lines + ["", ""]


def generate_attention(wl: Workload, s: Schedule) -> KernelSource:
    """A packed-sequence prefill workload's Gluon kernel for schedule `s` (sm_90;
    schedules/attention_space.py says which schedules it takes)."""
    op, attrs, dim = wl.op, wl.attr, wl.dim
    [att] = [st for st in op.body(attrs) if isinstance(st, Attend)]
    assert att.kind == "prefill" and "prefix_lens" not in op.tensors, "Gluon attention serves packed prefill"
    consumers, pingpong = s["consumers"], bool(s["pingpong"])
    em = GluonEmitter(op, attrs, {})
    name = f"{op.name}_kernel"
    args = kernel_args(wl, {"BLOCK_M": ROWS * consumers, "BLOCK_N": s["block_n"], "STAGES": s["num_stages"]})
    params = [a.name + (f": {NS}.constexpr" if a.kind == "constexpr" else "") for a in args]
    lines = module_header(wl, s, name, args)
    dt = dtypes.TL[attrs["dtype"]].replace("tl.", f"{NS}.")
    top = Scope(lines, "    ", {})
    grid_dependency(top)
    top.line(f"h = {NS}.program_id(1)")
    top.line(f"kvh = h // {dim['Hq'] // dim['Hkv']}")
    _sequence_of_tile(top, SEQ_LAYOUT)
    top.line(f"pid_m = {NS}.cdiv(n, BLOCK_M) - 1 - nth  # each sequence's longest (causal) tiles first")
    top.line("m0 = pid_m * BLOCK_M")
    top.line(f"n_tiles = {NS}.maximum({NS}.cdiv({NS}.minimum(n, m0 + BLOCK_M), BLOCK_N), 1)  "
             "# a program past its sequence's tiles walks one and stores nothing")
    for t, heads, block in (("q", "Hq", "BLOCK_M"), ("k", "Hkv", "BLOCK_N"), ("v", "Hkv", "BLOCK_N")):
        top.line(f"{t}_layout: {NS}.constexpr = {NS}.NVMMASharedLayout.get_default_for([{block}, 1, D], {dt})")
        top.line(f"{t}_desc = tma.make_tensor_descriptor({t}_ptr, shape=[T, {heads}, D], strides=[{t}_s0, {t}_s1, 1], "
                 f"block_shape=[{block}, 1, D], layout={t}_layout)")
    top.line(f"q_tile = {NS}.allocate_shared_memory({dt}, [BLOCK_M, 1, D], q_layout)")
    for t in ("k", "v"):
        top.line(f"{t}_ring = {NS}.allocate_shared_memory({dt}, [STAGES, BLOCK_N, 1, D], {t}_layout)")
    top.line(f"q_ready = {NS}.allocate_shared_memory({NS}.int64, [1], mbarrier.MBarrierLayout())")
    bars = ["ready", "free"] + (["turn"] if pingpong else [])
    for bar, count in zip(bars, ("STAGES", "STAGES", "2")):
        top.line(f"{bar} = {NS}.allocate_shared_memory({NS}.int64, [{count}, 1], mbarrier.MBarrierLayout())")
    top.line("mbarrier.init(q_ready, count=1)")
    top.line(f"for i in {NS}.static_range(STAGES):")
    top.line("    mbarrier.init(ready.index(i), count=1)")
    top.line(f"    mbarrier.init(free.index(i), count={consumers})  # every consumer has read the slot")
    if pingpong:
        top.line(f"for i in {NS}.static_range(2):")
        top.line("    mbarrier.init(turn.index(i), count=1)")
    top.line("fence_async_shared()  # the barriers are initialized before any copy signals them")
    shared = ["q_tile", "k_ring", "v_ring", "q_ready", "ready", "free", *(["turn"] if pingpong else []),
              "s0", "n", "h", "m0", "n_tiles"]
    top.line(f"{NS}.warp_specialize([")
    for first in range(consumers):  # the default partition first; a second consumer is a worker
        top.line(f"    (_attend_rows, ({', '.join([a.name for a in args] + shared + [str(first)])})),")
    top.line("    (_load_kv, (q_desc, k_desc, v_desc, q_tile, k_ring, v_ring, q_ready, ready, free, s0, h, kvh, m0, "
             "n_tiles, BLOCK_N, STAGES)),")
    top.line(f"], {[WARPGROUP] * (consumers - 1) + [1]}, {[CONSUMER_REGS] * (consumers - 1) + [PRODUCER_REGS]})")
    helpers = _LOAD_KV + _attend_rows(em, att, params, pingpong, dt)
    head = lines.index("@gluon.jit")
    lines[head:head] = helpers
    return KernelSource(name, to_gluon(em.finish(lines)), args, (ROWS * consumers, 1), tile_cols=True,
                        seq_tiles="B", dialect="gluon")
