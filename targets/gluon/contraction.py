"""The contraction class in Gluon, for Hopper: TMA copies into a ring of shared-memory stages,
mbarrier hand-offs, asynchronous warpgroup MMA, the op's epilogue in the accumulator's own layout.

Workloads whose A and W tiles are plain loads (ir/contraction.py `tma_operands`: 16-bit, int8 and
fp8 operands, and every weight dequantized first, targets/staged.py); int4 codes go to int4.py's tiles,
gemm_w4a8's `lanes` codes to lanes.py's. One program computes a
block_m x block_n output tile, numbered as the Triton kernel numbers them (`tile_order`). Its k
steps flow through `num_stages` ring slots, each with a `ready` barrier (the TMA copy's bytes have
landed) and a `free` barrier (the MMA that read it is done). With `producer_warps` = 1 one extra
warp only issues the copies (`_load_tiles`) while the program's warps only issue MMAs
(`_mma_tiles`), `gl.warp_specialize` giving the copy warp few registers and the MMA warps the rest;
with 0 the same warps do both, copying `num_stages` - 1 steps ahead (`_pipelined_tiles`). An MMA is
retired one step later (`warpgroup_mma_wait(1)`), so each overlaps the next step's wait.

One function writes each part of the kernel: the tile and k-step counts (`_counts`), the operands'
rings (`_operand_rings`), a TMA store's tile (`_output_tile`), the barriers (`_barriers`), then the
copy warp and MMA partitions (`_specialized`: `_load_tiles`, `_mma_tiles`, `_partitions`) or the one
partition (`_one_partition`). The start and the epilogue are tile.py's, shared with int4.py's tiles.
"""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.ir.contraction import (WARPGROUP, WARPGROUP_ROWS, gluon_int4_operands, gluon_lane_operands, operand_dtype,
                                     tma_operands, tma_output)
from flashgen.ir.variants import count, variant
from flashgen.targets.gluon.emit import CONSUMER_REGS, NS, PRODUCER_REGS, def_params, grid_dependency
from flashgen.targets.gluon.int4 import generate_int4
from flashgen.targets.gluon.lanes import generate_lanes
from flashgen.targets.gluon.tile import Tile, epilogue, start
from flashgen.targets.triton.contraction.kernel import tile_order
from flashgen.targets.triton.emit import KernelSource, Scope
from flashgen.workload import Schedule, Workload

GL = {"fp32": "gl.float32", "int32": "gl.int32"}

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


def _load_tiles() -> list[str]:
    """The copy warp: a slot is refilled once the MMA that read it has handed it back."""
    lines = ["@gluon.jit",
             "def _load_tiles(a_desc, w_desc, a_ring, w_ring, ready, free, tiles_m, tiles_n, k_steps,",
             "                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,",
             "                GROUP_M: gl.constexpr, STAGES: gl.constexpr):",
             "    # the copy warp: a slot is refilled once the MMA that read it has handed it back"]
    tile = _tile_loop(Scope(lines, "    ", {}))
    tile.line("for ki in range(k_steps):")
    for line in ["s = it % STAGES", "mbarrier.wait(free.index(s), ((it // STAGES) & 1) ^ 1)", *_copy("s", "ki"),
                 "it += 1"]:
        tile.line("    " + line)
    return lines + ["", ""]


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


def generate_contraction(wl: Workload, s: Schedule) -> KernelSource:
    """A contraction workload's Gluon kernel for schedule `s` (sm_90; schedules/contraction_space.py
    says which schedules it takes)."""
    pair = tma_operands(wl)
    if pair is None:
        if gluon_lane_operands(wl):
            return generate_lanes(wl, s)
        assert gluon_int4_operands(wl), "Gluon contraction tiles take plain, int4-code or lanes-code W loads"
        return generate_int4(wl, s)
    t = start(wl, s, {"BLOCK_M": s["block_m"], "BLOCK_N": s["block_n"], "BLOCK_K": s["block_k"],
                      "GROUP_M": count(s, "group_m"), "STAGES": s["num_stages"]})
    assert t.body.index(t.con) == 0, "a row pass before the contraction gives A a prologue"
    staged = tma_output(wl) if variant(s).option("tma_store") else None
    _counts(t)
    _operand_rings(t, pair)
    if staged:
        _output_tile(t, staged)
    _barriers(t)
    helpers = _specialized(t, staged) if variant(s).option("producer_warps") else _one_partition(t, staged)
    return KernelSource(t.name, t.module(helpers), t.args, (s["block_m"], s["block_n"]), tile_cols=True,
                        flat=True, dialect="gluon", persistent=count(s, "persistent"))


def _counts(t: Tile) -> None:
    """The wait for the previous kernel, then the counts every partition's walk reads: the output's
    row and column tiles and the k steps of each."""
    grid_dependency(t.top)
    t.top.line(f"tiles_m = {NS}.cdiv({t.rows}, BLOCK_M)")
    t.top.line(f"tiles_n = {NS}.cdiv({t.cols}, BLOCK_N)")
    t.top.line(f"k_steps = {NS}.cdiv({t.em.emit(t.con.extent, t.top)}, BLOCK_K)")


def _operand_rings(t: Tile, pair: tuple[str, str]) -> None:
    """TMA descriptors of the A and W tensors, and a ring of STAGES shared-memory slots for each in the
    swizzled layout the warpgroup MMA reads."""
    operand = dtypes.TL[operand_dtype(t.wl)].replace("tl.", f"{NS}.")
    a, w = pair
    for tensor, ring, block in ((a, "a", "BLOCK_M"), (w, "w", "BLOCK_N")):
        shape = ", ".join(t.em.emit(d, t.top) for d in t.wl.op.tensors[tensor].shape)
        t.top.line(f"{ring}_layout: {NS}.constexpr = {NS}.NVMMASharedLayout.get_default_for([{block}, BLOCK_K], {operand})")
        t.top.line(f"{ring}_desc = tma.make_tensor_descriptor({tensor}_ptr, shape=[{shape}], strides=[{tensor}_s0, 1], "
                   f"block_shape=[{block}, BLOCK_K], layout={ring}_layout)")
        t.top.line(f"{ring}_ring = {NS}.allocate_shared_memory({operand}, [STAGES, {block}, BLOCK_K], {ring}_layout)")


def _output_tile(t: Tile, staged: str) -> None:
    """The TMA store's descriptor of the `staged` output and its shared-memory tile, one per consumer
    (each stores its own tiles, and its copy runs on while it computes the next)."""
    op, consumers = t.wl.op, variant(t.s).option("consumers")
    out_dt = dtypes.TL[op.dtype_of(staged, t.wl.attr)].replace("tl.", f"{NS}.")
    shape = ", ".join(t.em.emit(d, t.top) for d in op.tensors[staged].shape)
    t.top.line(f"{staged}_layout: {NS}.constexpr = {NS}.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], {out_dt})")
    t.top.line(f"{staged}_desc = tma.make_tensor_descriptor({staged}_ptr, shape=[{shape}], strides=[{staged}_s0, 1], "
               f"block_shape=[BLOCK_M, BLOCK_N], layout={staged}_layout)")
    tiles = f"{consumers}, " if consumers > 1 else ""  # a tile per consumer
    t.top.line(f"{staged}_tile = {NS}.allocate_shared_memory({out_dt}, [{tiles}BLOCK_M, BLOCK_N], {staged}_layout)")


def _barriers(t: Tile) -> None:
    """The ring's barriers: `ready` (a slot's copies have landed), `free` where a copy warp refills
    slots (the MMA that read one is done), `turn` where two consumers take turns; all initialized and
    fenced before any copy signals one."""
    top, consumers = t.top, variant(t.s).option("consumers")
    barriers = ("ready", "free") if variant(t.s).option("producer_warps") else ("ready",)
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


def _acc_layout(t: Tile) -> str:
    """The accumulator's register layout, the warpgroup MMA's: num_warps along the rows, 32 bytes of k
    per instruction."""
    k_per_instr = 32 // dtypes.BYTES[operand_dtype(t.wl)]  # a warpgroup MMA reads 32 bytes of k per row
    return (f"acc_layout: {NS}.constexpr = {NS}.NVMMADistributedLayout(version=[3, 0], "
            f"warps_per_cta=[{t.s['num_warps']}, 1], instr_shape=[{WARPGROUP_ROWS}, BLOCK_N, {k_per_instr}])")


def _specialized(t: Tile, staged: str | None) -> list[str]:
    """With a copy warp: its partition and the MMA warps' as helpers, and the kernel's call that starts
    them; returns the helpers."""
    ring = ["a_ring", "w_ring", "ready", "free", "tiles_m", "tiles_n", "k_steps",
            *([f"{staged}_desc", f"{staged}_tile"] if staged else [])]
    helpers = _load_tiles() + _mma_tiles(t, ring, staged)
    _partitions(t, ring, staged)
    return helpers


def _mma_tiles(t: Tile, ring: list[str], staged: str | None) -> list[str]:
    """The MMA warps' partition: they walk the same tiles as the copy warp, each tile's epilogue in
    their partition while the copy warp already fills the ring with the next tile's steps."""
    consumers, sync = variant(t.s).option("consumers"), t.s["num_warps"] > WARPGROUP
    pingpong = ["turn", "first"] if consumers > 1 else []
    lines = ["@gluon.jit", f"def _mma_tiles({', '.join(def_params(t.args) + ring + pingpong)}):",
             "    # the MMA warps: each step's MMA runs while the next step's copy is awaited", f"    {_acc_layout(t)}"]
    tile = _tile_loop(Scope(lines, "    ", dict(t.top.axes)), consumers)
    tile.line(f"acc = {NS}.zeros([BLOCK_M, BLOCK_N], {GL[t.con.acc]}, acc_layout)")
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
    epilogue(t, tile, staged)
    if staged:
        lines.append("    tma.store_wait(0)  # the last tile's copy is done before the program ends")
    return lines + ["", ""]


def _partitions(t: Tile, ring: list[str], staged: str | None) -> None:
    """The kernel's `warp_specialize` call: the MMA partition first (the default; a second consumer is
    a worker, with its own output tile), then the copy warp, with their warps and registers."""
    top, consumers = t.top, variant(t.s).option("consumers")
    top.line(f"{NS}.warp_specialize([")
    mma_args = [x.name for x in t.args] + ring
    for first in range(consumers):
        call = [a.replace(f"{staged}_tile", f"{staged}_tile.index({first})") for a in mma_args] if consumers > 1 else mma_args
        top.line(f"    (_mma_tiles, ({', '.join(call + (['turn', str(first)] if consumers > 1 else []))})),")
    top.line("    (_load_tiles, (a_desc, w_desc, a_ring, w_ring, ready, free, tiles_m, tiles_n, k_steps, BLOCK_M, BLOCK_N,")
    top.line("                   BLOCK_K, GROUP_M, STAGES)),")
    warps = [t.s["num_warps"]] * (consumers - 1) + [variant(t.s).option("producer_warps")]
    regs = [CONSUMER_REGS] * (consumers - 1) + [PRODUCER_REGS]
    top.line(f"], {warps}, {regs})")


def _one_partition(t: Tile, staged: str | None) -> list[str]:
    """Without a copy warp: the program's one tile, its warps copying num_stages - 1 steps ahead of
    their MMAs (`_pipelined_tiles`, the helper returned), then its epilogue."""
    top = t.top
    top.line(f"pid = {NS}.program_id(0)")
    tile_order(top, NS)
    top.line("off_m = pid_m * BLOCK_M")
    top.line("off_n = pid_n * BLOCK_N")
    top.line(_acc_layout(t))
    top.line(f"acc = _pipelined_tiles(a_desc, w_desc, a_ring, w_ring, ready, off_m, off_n, k_steps, "
             f"BLOCK_M, BLOCK_N, BLOCK_K, STAGES, {GL[t.con.acc]}, acc_layout)")
    epilogue(t, top, staged)
    if staged:
        top.line("tma.store_wait(0)")
    return _pipelined_tiles(t.s["num_warps"] > WARPGROUP)
