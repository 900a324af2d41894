"""The attention class's prefill in Gluon, for Hopper: a producer warp copying the query tile and a
ring of key/value tiles by TMA, one or two consumer warpgroups of WARPGROUP_ROWS x WARPGROUP query
rows each, attending to every key tile of the ring with asynchronous warpgroup MMAs.

A query tile is block_m = 64 x consumers queries of one sequence and query head, numbered as the
Triton kernel numbers them (targets/triton/attention.py `_sequence_of_tile`, longest causal tiles
first), heads fastest (the query heads of one KV head run side by side and share its tiles in L2).
A program walks one tile of each round of num_programs tiles: one tile, or with `persistent`
(one program per SM) as many as there are rounds, every other round in reverse order so that the
programs' sums of causal work come out even. Every partition walks the same tiles; the key/value ring runs on across them, and the copy
warp brings a tile's queries as soon as the consumers' last logits MMA of the tile before is done, so
the next tile's copies overlap this one's last values and its epilogue. Key tiles stop at the
diagonal. A consumer's loop is software-pipelined: at step j it issues the logits of key tile j
(S = Q K^T) and the weighted values of tile j - 1 (O += P V, its probabilities in registers as the
MMA's A operand) back to back, then runs tile j's online softmax while both run; a ring slot goes back
to the copy warp once its values' MMA is done. With `pingpong` the two consumers take turns issuing
those MMAs (a turn barrier each), so one's softmax overlaps the other's MMAs and the tensor cores never
wait for both at once. Masks apply only on the key tiles that reach the diagonal (and on every tile,
under a mask other than the plain causal one); the op's score expression (softcap, alibi) is emitted
from the IR as in the Triton kernel. A TMA box copies whole rows: the value rows of a tile's last key
tile that lie past its sequence (the next sequence's, padding) are zeroed in their ring slot before
their MMA, since a masked logit's zero probability times a NaN or inf value is still NaN.

One function writes each part of the kernel: the shared tiles and rings (`_shared_tiles`), the
barriers (`_barriers`), the call starting the partitions (`_partitions`), the copy warp (`_load_kv`)
and a consumer (`_attend_rows`: its first key tile, each pipelined step, the last values and the
store).
"""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.ir.contraction import WARPGROUP, WARPGROUP_ROWS
from flashgen.ir.op import Attend
from flashgen.targets.gluon.emit import (CONSUMER_REGS, NS, PRODUCER_REGS, GluonEmitter, def_params, grid_dependency,
                                         module_header, module_text)
from flashgen.targets.triton.attention import CAUSAL, _logit, _sequence_of_tile
from flashgen.targets.triton.emit import KernelSource, Scope, kernel_args
from flashgen.workload import Schedule, Workload

ROWS = WARPGROUP * WARPGROUP_ROWS  # query rows of one consumer warpgroup (a warpgroup MMA's M)
RING = ["q_tile", "k_ring", "v_ring", "q_ready", "q_free", "ready", "free"]  # what the partitions share


def _tile_loop(scope: Scope, warps: int, group: int) -> Scope:
    """A partition's walk over its program's query tiles, in rounds of num_programs tiles, every other
    round in reverse program order: the tiles come longest first, so a program that took a round's
    longest tile takes the next round's shortest, and the programs end together. For each tile: `i`
    (its place in the walk: the query slot's phase), its query head `h` and KV head `kvh`, its sequence
    (`s0`, `n`), first row `m0` and key tiles `n_tiles`. `warps`: the partition's (the layout the
    sequence starts are read in)."""
    scope.line(f"for i in range(0, {NS}.cdiv(tiles, {NS}.num_programs(0))):")
    walk = scope.child(scope.indent + "    ")
    walk.line(f"pid = {NS}.program_id(0) + (i % 2) * ({NS}.num_programs(0) - 1 - 2 * {NS}.program_id(0))  "
              "# every other round backwards")
    walk.line(f"u = i * {NS}.num_programs(0) + pid")
    walk.line("if u < tiles:  # (the last round may be short)")
    tile = walk.child(walk.indent + "    ")
    tile.line("h = u % Hq")
    tile.line(f"kvh = h // {group}")
    _sequence_of_tile(tile, f"{NS}.BlockedLayout([1], [32], [{warps}], [0])", "u // Hq")
    tile.line(f"pid_m = {NS}.cdiv(n, BLOCK_M) - 1 - nth  # each sequence's longest (causal) tiles first")
    tile.line("m0 = pid_m * BLOCK_M")
    tile.line(f"n_tiles = {NS}.maximum({NS}.cdiv({NS}.minimum(n, m0 + BLOCK_M), BLOCK_N), 1)  "
              "# a tile past its sequence's walks one key tile and stores nothing")
    return tile


def _load_kv(params: list[str], group: int) -> list[str]:
    """The copy warp: each tile's queries once its slot is free, then its key/value tiles into ring
    slots the consumers handed back."""
    lines = ["@gluon.jit",
             f"def _load_kv({', '.join(params)}, q_desc, k_desc, v_desc, {', '.join(RING)}, tiles):",
             "    # the copy warp: each tile's queries, then its key/value tiles into slots the consumers handed back",
             "    it = 0  # key tiles through the ring so far: its slot and phase"]
    tile = _tile_loop(Scope(lines, "    ", {}), 1, group)
    for line in ["mbarrier.wait(q_free, (i & 1) ^ 1)  # the tile before's logits are done with the queries",
                 "mbarrier.expect(q_ready, q_desc.block_type.nbytes)",
                 "tma.async_copy_global_to_shared(q_desc, [s0 + m0, h, 0], q_ready, q_tile)",
                 "for j in range(n_tiles):",
                 "    s = (it + j) % STAGES",
                 "    mbarrier.wait(free.index(s), (((it + j) // STAGES) & 1) ^ 1)",
                 "    mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)",
                 "    tma.async_copy_global_to_shared(k_desc, [s0 + j * BLOCK_N, kvh, 0], ready.index(s), k_ring.index(s))",
                 "    tma.async_copy_global_to_shared(v_desc, [s0 + j * BLOCK_N, kvh, 0], ready.index(s), v_ring.index(s))",
                 "it += n_tiles"]:
        tile.line(line)
    return lines + ["", ""]


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


def _values_past_sequence(tile: Scope, d: int) -> None:
    """Zeros in the value rows of the tile's last key tile (ring slot `last`) that lie past the sequence:
    a TMA box copies whole rows, the next sequence's or the padding's, and their zero probabilities
    would still make NaN of a NaN or inf value there. Only the last key tile can reach past the
    sequence. Both consumers may rewrite the slot at once, harmlessly: each writes the sequence's rows
    back as copied and zeros past it, the same bytes as the other."""
    cols = min(32, d // 8)  # threads along a row, 8 values (16 bytes) each
    tile.line("if n_tiles * BLOCK_N > n:")
    past = tile.child(tile.indent + "    ")
    past.line(f"v_layout: gl.constexpr = gl.BlockedLayout([1, 8], [{32 // cols}, {cols}], [{WARPGROUP}, 1], [1, 0])")
    past.line(f"v_last = {_slot('v_ring', 'last')}")
    past.line("v_row = (n_tiles - 1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_layout))[:, None]")
    past.line("v_last.store(gl.where(v_row < n, v_last.load(v_layout), 0.0))")
    past.line("fence_async_shared()  # the values MMA (the async proxy) reads what the warpgroup wrote")
    past.line("gl.thread_barrier()  # every warp's rows, before the warpgroup's MMA")


def _attend_rows(em: GluonEmitter, att: Attend, params: list[str], pingpong: bool, dt: str, group: int,
                 d: int) -> list[str]:
    """A consumer warpgroup: for each of the program's query tiles, rows [r0, r0 + ROWS) of it against
    every key tile up to the diagonal."""
    lines = ["@gluon.jit",
             f"def _attend_rows({', '.join(params)}, {', '.join(RING)}, {'turn, ' if pingpong else ''}tiles, first):",
             "    # a consumer warpgroup: its query rows' logits and weighted values, tile after tile of keys",
             "    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], "
             f"instr_shape=[{WARPGROUP_ROWS}, BLOCK_N, 16])",
             "    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], "
             f"instr_shape=[{WARPGROUP_ROWS}, D, 16])",
             "    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)",
             f"    q = q_tile.reshape([BLOCK_M, D]).slice(first * {ROWS}, {ROWS})",
             "    scale = 1.0 / gl.sqrt(D * 1.0)",
             "    it = 0  # key tiles through the ring so far: its slot and phase"]
    tile = _tile_loop(Scope(lines, "    ", {}), WARPGROUP, group)
    tile.axes.update({"h": ("h", None), "qpos": ("qpos", None), "kpos": ("kpos", "jmask")})
    _first_key_tile(em, att, tile, dt)
    tile.line("for j in range(1, n_tiles):")
    _key_tile(em, att, tile.child(tile.indent + "    "), pingpong, dt)
    _last_values(tile, d, dt)
    return lines + ["", ""]


def _first_key_tile(em: GluonEmitter, att: Attend, tile: Scope, dt: str) -> None:
    """The tile's running max, sum and values zeroed, its queries awaited, and the first key tile's
    logits and softmax: the pipelined loop then always has a tile's values to issue beside the next
    tile's logits."""
    for line in [f"r0 = m0 + first * {ROWS}",
                 f"qpos = r0 + gl.arange(0, {ROWS}, layout=gl.SliceLayout(1, s_layout))[:, None]",
                 f"m_i = gl.full([{ROWS}], float(\"-inf\"), gl.float32, gl.SliceLayout(1, s_layout))",
                 f"l_i = gl.zeros([{ROWS}], gl.float32, gl.SliceLayout(1, s_layout))",
                 f"acc = gl.zeros([{ROWS}, D], gl.float32, o_layout)",
                 "mbarrier.wait(q_ready, i & 1)",
                 "mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)",
                 _logits_mma("it % STAGES"),
                 "sc = warpgroup_mma_wait(0, deps=[sc])"]:
        tile.line(line)
    _softmax(em, att, tile, "0", dt)


def _key_tile(em: GluonEmitter, att: Attend, body: Scope, pingpong: bool, dt: str) -> None:
    """Step j of the consumer's loop: key tile j's logits and tile j - 1's values MMAs issued back to
    back (taking turns with the other consumer under `pingpong`), tile j's softmax while both run, then
    the slot of tile j - 1 handed back and the values rescaled."""
    body.line("g = it + j")
    body.line("slot = g % STAGES")
    body.line("prev = (g - 1) % STAGES")
    body.line("mbarrier.wait(ready.index(slot), (g // STAGES) & 1)")
    if pingpong:  # (every tile before this one took n_tiles - 1 turns: it - i in all)
        body.line("mbarrier.wait(turn.index(first), ((g - 1 - i) & 1) ^ (1 - first))  # the other's MMAs are issued")
    body.line(_logits_mma("slot"))
    body.line(_values_mma("prev") + "  # tile j - 1's, rescaled")
    if pingpong:
        body.line("mbarrier.arrive(turn.index(1 - first))  # its turn: this softmax overlaps its MMAs")
    body.line("sc = warpgroup_mma_wait(1, deps=[sc])  # the logits; the values' MMA runs on")
    _softmax(em, att, body, "j * BLOCK_N", dt)
    body.line("acc = warpgroup_mma_wait(0, deps=[acc])")
    body.line("mbarrier.arrive(free.index(prev))  # hand that slot back")
    body.line("acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]")


def _last_values(tile: Scope, d: int, dt: str) -> None:
    """The tile's end: the queries' slot freed for the next tile, the last key tile's values (rows past
    the sequence zeroed first), the rows normalized by their sums and stored where they lie in their
    sequence."""
    tile.line("mbarrier.arrive(q_free)  # the tile's logits are done: the next tile's queries may come")
    tile.line("last = (it + n_tiles - 1) % STAGES")
    _values_past_sequence(tile, d)
    for line in [_values_mma("last"),
                 "acc = warpgroup_mma_wait(0, deps=[acc])",
                 "mbarrier.arrive(free.index(last))",
                 "it += n_tiles",
                 "l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))",
                 "out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]",
                 f"r = r0 + gl.arange(0, {ROWS}, layout=gl.SliceLayout(1, o_layout))[:, None]",
                 "dd = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))[None, :]",
                 f"gl.store(out_ptr + (s0 + r).to(gl.int64) * out_s0 + h * out_s1 + dd, out.to({dt}), "
                 "mask=(r >= 0) & (r < n))"]:
        tile.line(line)


def generate_attention(wl: Workload, s: Schedule) -> KernelSource:
    """A packed-sequence prefill workload's Gluon kernel for schedule `s` (sm_90;
    schedules/attention_space.py says which schedules it takes)."""
    op, attrs, dim = wl.op, wl.attr, wl.dim
    [att] = [st for st in op.body(attrs) if isinstance(st, Attend)]
    assert att.kind == "prefill" and "prefix_lens" not in op.tensors, "Gluon attention serves packed prefill"
    consumers, pingpong, group = s["consumers"], bool(s["pingpong"]), dim["Hq"] // dim["Hkv"]
    em = GluonEmitter(op, attrs, {})
    name = f"{op.name}_kernel"
    args = kernel_args(wl, {"BLOCK_M": ROWS * consumers, "BLOCK_N": s["block_n"], "STAGES": s["num_stages"]})
    lines = module_header(wl, s, name, args)
    dt = dtypes.TL[attrs["dtype"]].replace("tl.", f"{NS}.")
    top = Scope(lines, "    ", {})
    grid_dependency(top)
    top.line(f"tiles = {NS}.minimum({NS}.cdiv(T, BLOCK_M) + B, T) * Hq  # as many as the grid of one program per tile")
    _shared_tiles(top, dt)
    _barriers(top, consumers, pingpong)
    _partitions(top, [a.name for a in args], consumers, pingpong)
    params = def_params(args)
    helpers = _load_kv(params, group) + _attend_rows(em, att, params, pingpong, dt, group, dim["D"])
    return KernelSource(name, module_text(em, lines, helpers), args, (ROWS * consumers, 1), tile_cols=True,
                        seq_tiles="B", flat=True, persistent=s["persistent"], dialect="gluon")


def _shared_tiles(top: Scope, dt: str) -> None:
    """TMA descriptors of q, k and v (a box of rows of one head), the query tile and the key and value
    rings of STAGES slots in shared memory."""
    for t, heads, block in (("q", "Hq", "BLOCK_M"), ("k", "Hkv", "BLOCK_N"), ("v", "Hkv", "BLOCK_N")):
        top.line(f"{t}_layout: {NS}.constexpr = {NS}.NVMMASharedLayout.get_default_for([{block}, 1, D], {dt})")
        top.line(f"{t}_desc = tma.make_tensor_descriptor({t}_ptr, shape=[T, {heads}, D], strides=[{t}_s0, {t}_s1, 1], "
                 f"block_shape=[{block}, 1, D], layout={t}_layout)")
    top.line(f"q_tile = {NS}.allocate_shared_memory({dt}, [BLOCK_M, 1, D], q_layout)")
    for t in ("k", "v"):
        top.line(f"{t}_ring = {NS}.allocate_shared_memory({dt}, [STAGES, BLOCK_N, 1, D], {t}_layout)")


def _barriers(top: Scope, consumers: int, pingpong: bool) -> None:
    """The hand-offs: the query tile's `q_ready` (copied) and `q_free` (every consumer's logits done
    with it), each ring slot's `ready` and `free` (every consumer has read it), and under `pingpong` a
    `turn` per consumer; all initialized and fenced before any copy signals one."""
    for bar in ("q_ready", "q_free"):
        top.line(f"{bar} = {NS}.allocate_shared_memory({NS}.int64, [1], mbarrier.MBarrierLayout())")
    bars = ["ready", "free"] + (["turn"] if pingpong else [])
    for bar, count in zip(bars, ("STAGES", "STAGES", "2")):
        top.line(f"{bar} = {NS}.allocate_shared_memory({NS}.int64, [{count}, 1], mbarrier.MBarrierLayout())")
    top.line("mbarrier.init(q_ready, count=1)")
    top.line(f"mbarrier.init(q_free, count={consumers})  # every consumer's logits are done with the queries")
    top.line(f"for i in {NS}.static_range(STAGES):")
    top.line("    mbarrier.init(ready.index(i), count=1)")
    top.line(f"    mbarrier.init(free.index(i), count={consumers})  # every consumer has read the slot")
    if pingpong:
        top.line(f"for i in {NS}.static_range(2):")
        top.line("    mbarrier.init(turn.index(i), count=1)")
    top.line("fence_async_shared()  # the barriers are initialized before any copy signals them")


def _partitions(top: Scope, names: list[str], consumers: int, pingpong: bool) -> None:
    """The kernel's `warp_specialize` call: the consumer warpgroups (the first is the default partition,
    a second a worker of CONSUMER_REGS registers) and the copy warp of few registers."""
    top.line(f"{NS}.warp_specialize([")
    for first in range(consumers):
        top.line(f"    (_attend_rows, ({', '.join(names + RING + (['turn'] if pingpong else []) + ['tiles', str(first)])})),")
    top.line(f"    (_load_kv, ({', '.join(names + ['q_desc', 'k_desc', 'v_desc'] + RING + ['tiles'])})),")
    top.line(f"], {[WARPGROUP] * (consumers - 1) + [1]}, {[CONSUMER_REGS] * (consumers - 1) + [PRODUCER_REGS]})")
