"""The contraction class in Gluon, for Hopper: TMA copies into a ring of shared-memory stages,
mbarrier hand-offs, asynchronous warpgroup MMA, the op's epilogue in the accumulator's own layout.

Workloads whose A and W tiles are plain loads (ir/contraction.py `tma_operands`: 16-bit, int8 and
fp8 operands, and every weight dequantized first, targets/staged.py). One program computes a
block_m x block_n output tile, numbered as the Triton kernel numbers them (`tile_order`). Its k
steps flow through `num_stages` ring slots, each with a `ready` barrier (the TMA copy's bytes have
landed) and a `free` barrier (the MMA that read it is done). With `producer_warps` = 1 one extra
warp only issues the copies (`_load_tiles`) while the program's warps only issue MMAs
(`_mma_tiles`), `gl.warp_specialize` giving the copy warp few registers and the MMA warps the rest;
with 0 the same warps do both, copying `num_stages` - 1 steps ahead (`_pipelined_tiles`). An MMA is
retired one step later (`warpgroup_mma_wait(1)`), so each overlaps the next step's wait.
"""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.ir.contraction import (WARPGROUP, WARPGROUP_ROWS, gluon_int4_operands, operand_dtype, tma_operands,
                                     tma_output)
from flashgen.ir.op import Contract, Let, Store, eval_int
from flashgen.targets.gluon.emit import NS, GluonEmitter, grid_dependency, module_header, to_gluon
from flashgen.targets.gluon.int4 import generate_int4
from flashgen.targets.triton.contraction.kernel import tile_order
from flashgen.targets.triton.emit import KernelSource, Scope, kernel_args
from flashgen.workload import Schedule, Workload

GL = {"fp32": "gl.float32", "int32": "gl.int32"}
PRODUCER_REGS = 40  # registers per thread of the copy warp (it holds only addresses and loop state)
CONSUMER_REGS = 224  # and of a second consumer warpgroup: with the default one's 256 and the copy warp's 40, in 64K

_MMA_STEP = ["s = it % STAGES",
             "mbarrier.wait(ready.index(s), (it // STAGES) & 1)",
             "acc = warpgroup_mma(a_ring.index(s), w_ring.index(s).permute((1, 0)), acc, is_async=True)",
             "acc = warpgroup_mma_wait(1, deps=[acc])  # the previous step's MMA is done"]
_SYNC = ["gl.thread_barrier()  # in every warpgroup: the previous step's slot is read"]


def _copy(slot: str, step: str, pred: str = "") -> list[str]:
    """A k step's TMA copies of the A and W tiles into ring slot `slot`, signalling its ready barrier."""
    p = f", pred={pred}" if pred else ""
    return [f"mbarrier.expect(ready.index({slot}), a_desc.block_type.nbytes + w_desc.block_type.nbytes{p})",
            f"tma.async_copy_global_to_shared(a_desc, [off_m, {step} * BLOCK_K], ready.index({slot}), a_ring.index({slot}){p})",
            f"tma.async_copy_global_to_shared(w_desc, [off_n, {step} * BLOCK_K], ready.index({slot}), w_ring.index({slot}){p})"]


def _block(indent: str, lines: list[str]) -> list[str]:
    return [indent + line for line in lines]


def _tile_loop(scope: Scope, consumers: int = 1) -> Scope:
    """The loop over the program's tiles (one, unless the program is persistent: then every
    num_programs-th tile), their row and column offsets, and the ring's step count `it` across them.
    With two consumers, consumer `first` takes every other tile of the program's sequence; the ring
    position of its tile is where the copy warp, walking every tile, put it."""
    if consumers == 1:
        scope.line("it = 0  # k steps through the ring so far: its slot and phase")
        scope.line(f"for pid in range({NS}.program_id(0), tiles_m * tiles_n, {NS}.num_programs(0)):")
        inner = scope.child(scope.indent + "    ")
    else:
        scope.line(f"tiles = {NS}.cdiv(tiles_m * tiles_n - {NS}.program_id(0), {NS}.num_programs(0))  # the program's")
        scope.line(f"for q in range(first, tiles, {consumers}):")
        inner = scope.child(scope.indent + "    ")
        inner.line(f"pid = {NS}.program_id(0) + q * {NS}.num_programs(0)")
        inner.line("it = q * k_steps  # the ring steps of the program's tiles before this one")
    tile_order(inner, NS)
    inner.line("off_m = pid_m * BLOCK_M")
    inner.line("off_n = pid_n * BLOCK_N")
    return inner


def _load_tiles(lines: list[str]) -> None:
    """The copy warp: a slot is refilled once the MMA that read it has handed it back."""
    lines += ["@gluon.jit",
              "def _load_tiles(a_desc, w_desc, a_ring, w_ring, ready, free, tiles_m, tiles_n, k_steps,",
              "                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,",
              "                GROUP_M: gl.constexpr, STAGES: gl.constexpr):",
              "    # the copy warp: a slot is refilled once the MMA that read it has handed it back"]
    tile = _tile_loop(Scope(lines, "    ", {}))
    tile.line("for ki in range(k_steps):")
    for line in ["s = it % STAGES", "mbarrier.wait(free.index(s), ((it // STAGES) & 1) ^ 1)", *_copy("s", "ki"),
                 "it += 1"]:
        tile.line("    " + line)
    lines += ["", ""]


def _pipelined_tiles(sync: bool) -> list[str]:
    """The k loop of a tile whose warps issue both its copies and its MMAs. `sync`: the MMAs span
    several warpgroups, which all finish reading a slot (a barrier) before it is refilled."""
    return ["@gluon.jit",
            "def _pipelined_tiles(a_desc, w_desc, a_ring, w_ring, ready, off_m, off_n, k_steps, BLOCK_M: gl.constexpr,",
            "                     BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,",
            "                     ACC_DTYPE: gl.constexpr, ACC_LAYOUT: gl.constexpr):",
            "    # copies run STAGES - 1 steps ahead of the MMAs, into the slot the previous step's MMA read",
            "    for i in gl.static_range(STAGES - 1):",
            *_block("        ", _copy("i", "i", "i < k_steps")),
            "    acc = gl.zeros([BLOCK_M, BLOCK_N], ACC_DTYPE, ACC_LAYOUT)",
            "    for ki in range(k_steps):",
            *_block("        ", ["it = ki", *_MMA_STEP, *(_SYNC if sync else [])]),
            "        nk = ki + STAGES - 1",
            *_block("        ", _copy("nk % STAGES", "nk", "nk < k_steps")),
            "    acc = warpgroup_mma_wait(0, deps=[acc])",
            "    return acc", "", ""]


def _epilogue(em: GluonEmitter, scope: Scope, stores: tuple, rows: str, cols: str, cmask: str | None,
              staged: str | None) -> None:
    """The op's stores in the accumulator's layout: the tile's rows and columns are its slices. The
    `staged` output's tile goes through shared memory and a TMA copy, which runs on while the program
    computes its next tile (the copy before it must have left the buffer first)."""
    scope.line(f"r = off_m + {NS}.arange(0, BLOCK_M, layout={NS}.SliceLayout(1, acc_layout))[:, None]")
    scope.line(f"rmask = r < {rows}")
    scope.line(f"c = off_n + {NS}.arange(0, BLOCK_N, layout={NS}.SliceLayout(0, acc_layout))[None, :]")
    if cmask:
        scope.line(f"cmask = c < {cols}")
    for st in stores:
        if not isinstance(st, Store):
            continue
        if st.tensor != staged:
            em.store(st, scope)
            continue
        v = em.emit(st.value, scope)
        scope.line("tma.store_wait(0)  # the previous tile's copy has left the buffer")
        scope.line(f"{st.tensor}_tile.store({v}.to({dtypes.TL[em.op.dtype_of(st.tensor, em.attrs)]}))")
        scope.line("fence_async_shared()")
        scope.line(f"tma.async_copy_shared_to_global({st.tensor}_desc, [off_m, off_n], {st.tensor}_tile)")


def generate_contraction(wl: Workload, s: Schedule) -> KernelSource:
    """A contraction workload's Gluon kernel for schedule `s` (sm_90; schedules/contraction_space.py
    says which schedules it takes)."""
    pair = tma_operands(wl)
    if pair is None:
        assert gluon_int4_operands(wl), "Gluon contraction tiles take plain or int4-code W loads"
        return generate_int4(wl, s, _epilogue)
    op, attrs = wl.op, wl.attr
    body = op.body(attrs)
    [con] = [st for st in body if isinstance(st, Contract)]
    assert body.index(con) == 0, "a row pass before the contraction gives A a prologue"
    lets = {st.name: st.value for st in body if isinstance(st, Let)}
    em = GluonEmitter(op, attrs, lets)
    em.named[con.name] = "acc"
    name = f"{op.name}_kernel"
    consts = {"BLOCK_M": s["block_m"], "BLOCK_N": s["block_n"], "BLOCK_K": s["block_k"], "GROUP_M": s["group_m"],
              "STAGES": s["num_stages"]}
    args = kernel_args(wl, consts)
    lines = module_header(wl, s, name, args)
    m_extent, n_extent = op.domain
    cmask = "cmask" if eval_int(n_extent, wl.dim) % s["block_n"] else None
    top = Scope(lines, "    ", {"r": ("r", "rmask"), "c": ("c", cmask)})
    rows, cols = em.emit(m_extent, top), em.emit(n_extent, top)
    operand = dtypes.TL[operand_dtype(wl)].replace("tl.", f"{NS}.")
    k_per_instr = 32 // dtypes.BYTES[operand_dtype(wl)]  # a warpgroup MMA reads 32 bytes of k per row
    acc_layout = (f"acc_layout: {NS}.constexpr = {NS}.NVMMADistributedLayout(version=[3, 0], "
                  f"warps_per_cta=[{s['num_warps']}, 1], instr_shape=[{WARPGROUP_ROWS}, BLOCK_N, {k_per_instr}])")
    acc_dtype = GL[con.acc]
    sync = s["num_warps"] > WARPGROUP
    consumers = s["consumers"]
    a, w = pair

    grid_dependency(top)
    top.line(f"tiles_m = {NS}.cdiv({rows}, BLOCK_M)")
    top.line(f"tiles_n = {NS}.cdiv({cols}, BLOCK_N)")
    top.line(f"k_steps = {NS}.cdiv({em.emit(con.extent, top)}, BLOCK_K)")
    for tensor, ring, block in ((a, "a", "BLOCK_M"), (w, "w", "BLOCK_N")):
        shape = ", ".join(em.emit(d, top) for d in op.tensors[tensor].shape)
        top.line(f"{ring}_layout: {NS}.constexpr = {NS}.NVMMASharedLayout.get_default_for([{block}, BLOCK_K], {operand})")
        top.line(f"{ring}_desc = tma.make_tensor_descriptor({tensor}_ptr, shape=[{shape}], strides=[{tensor}_s0, 1], "
                 f"block_shape=[{block}, BLOCK_K], layout={ring}_layout)")
        top.line(f"{ring}_ring = {NS}.allocate_shared_memory({operand}, [STAGES, {block}, BLOCK_K], {ring}_layout)")
    staged = tma_output(wl) if s["tma_store"] else None
    if staged:
        out_dt = dtypes.TL[op.dtype_of(staged, attrs)].replace("tl.", f"{NS}.")
        shape = ", ".join(em.emit(d, top) for d in op.tensors[staged].shape)
        top.line(f"{staged}_layout: {NS}.constexpr = {NS}.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], {out_dt})")
        top.line(f"{staged}_desc = tma.make_tensor_descriptor({staged}_ptr, shape=[{shape}], strides=[{staged}_s0, 1], "
                 f"block_shape=[BLOCK_M, BLOCK_N], layout={staged}_layout)")
        tiles = f"{consumers}, " if consumers > 1 else ""  # a tile per consumer
        top.line(f"{staged}_tile = {NS}.allocate_shared_memory({out_dt}, [{tiles}BLOCK_M, BLOCK_N], {staged}_layout)")
    barriers = ("ready", "free") if s["producer_warps"] else ("ready",)
    for bar in barriers:
        top.line(f"{bar} = {NS}.allocate_shared_memory({NS}.int64, [STAGES, 1], mbarrier.MBarrierLayout())")
    top.line(f"for i in {NS}.static_range(STAGES):")
    for bar in barriers:
        top.line(f"    mbarrier.init({bar}.index(i), count=1)")
    if consumers > 1:
        # A consumer's k loop starts once the other's has issued its waits: a ring slot's ready barrier
        # is then never awaited more than one phase ahead.
        top.line(f"turn = {NS}.allocate_shared_memory({NS}.int64, [{consumers}, 1], mbarrier.MBarrierLayout())")
        top.line(f"for i in {NS}.static_range({consumers}):")
        top.line("    mbarrier.init(turn.index(i), count=1)")
    top.line("fence_async_shared()  # the barriers are initialized before any copy signals them")
    helpers: list[str] = []
    if s["producer_warps"]:
        # The MMA warps walk the same tiles as the copy warp, each tile's epilogue in their partition
        # while the copy warp already fills the ring with the next tile's steps.
        _load_tiles(helpers)
        params = [x.name + (f": {NS}.constexpr" if x.kind == "constexpr" else "") for x in args]
        ring = ["a_ring", "w_ring", "ready", "free", "tiles_m", "tiles_n", "k_steps",
                *([f"{staged}_desc", f"{staged}_tile"] if staged else [])]
        pingpong = ["turn", "first"] if consumers > 1 else []
        helpers += ["@gluon.jit", f"def _mma_tiles({', '.join(params + ring + pingpong)}):",
                    "    # the MMA warps: each step's MMA runs while the next step's copy is awaited", f"    {acc_layout}"]
        tile = _tile_loop(Scope(helpers, "    ", dict(top.axes)), consumers)
        tile.line(f"acc = {NS}.zeros([BLOCK_M, BLOCK_N], {acc_dtype}, acc_layout)")
        if consumers > 1:
            tile.line("mbarrier.wait(turn.index(first), ((q // 2) & 1) ^ (1 - first))  # the other's k loop is issued")
        tile.line("for ki in range(k_steps):")
        for line in [*_MMA_STEP, *(_SYNC if sync else []),
                     "mbarrier.arrive(free.index((it + STAGES - 1) % STAGES), pred=ki > 0)  # hand that slot back",
                     "it += 1"]:
            tile.line("    " + line)
        if consumers > 1:
            tile.line("mbarrier.arrive(turn.index(1 - first))  # its turn: this epilogue overlaps its MMAs")
        tile.line("acc = warpgroup_mma_wait(0, deps=[acc])")
        if sync:
            tile.line(_SYNC[0])
        tile.line("mbarrier.arrive(free.index((it + STAGES - 1) % STAGES))  # and the tile's last slot")
        _epilogue(em, tile, body[1:], rows, cols, cmask, staged)
        if staged:
            helpers.append("    tma.store_wait(0)  # the last tile's copy is done before the program ends")
        helpers += ["", ""]
        top.line(f"{NS}.warp_specialize([")
        mma_args = [x.name for x in args] + ring
        for first in range(consumers):  # the default partition first; a second consumer is a worker
            call = [a.replace(f"{staged}_tile", f"{staged}_tile.index({first})") for a in mma_args] if consumers > 1 else mma_args
            top.line(f"    (_mma_tiles, ({', '.join(call + (['turn', str(first)] if consumers > 1 else []))})),")
        top.line("    (_load_tiles, (a_desc, w_desc, a_ring, w_ring, ready, free, tiles_m, tiles_n, k_steps, BLOCK_M, BLOCK_N,")
        top.line("                   BLOCK_K, GROUP_M, STAGES)),")
        warps = [s["num_warps"]] * (consumers - 1) + [s["producer_warps"]]
        regs = [CONSUMER_REGS] * (consumers - 1) + [PRODUCER_REGS]
        top.line(f"], {warps}, {regs})")
    else:
        helpers = _pipelined_tiles(sync)
        top.line(f"pid = {NS}.program_id(0)")
        tile_order(top, NS)
        top.line("off_m = pid_m * BLOCK_M")
        top.line("off_n = pid_n * BLOCK_N")
        top.line(acc_layout)
        top.line(f"acc = _pipelined_tiles(a_desc, w_desc, a_ring, w_ring, ready, off_m, off_n, k_steps, "
                 f"BLOCK_M, BLOCK_N, BLOCK_K, STAGES, {acc_dtype}, acc_layout)")
        _epilogue(em, top, body[1:], rows, cols, cmask, staged)
        if staged:
            top.line("tma.store_wait(0)")
    head = lines.index("@gluon.jit")
    lines[head:head] = helpers
    return KernelSource(name, to_gluon(em.finish(lines)), args, (s["block_m"], s["block_n"]), tile_cols=True,
                        flat=True, dialect="gluon", persistent=s["persistent"])
