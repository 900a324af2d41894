"""Int4-weight contraction tiles in Gluon, for Hopper: the unpacked weight is the warpgroup MMA's
register operand, so shared memory holds packed words and activations only, never a dequantized tile.

The tile is computed transposed, acc^T [block_n, block_m] = W x^T (as the Triton generator's int4
matrix tiles are, targets/triton/contraction/int4_mma.py): block_n weight rows are the MMA's 64-row
side, one warpgroup per 64 rows, and block_m activation rows its narrow side, down to 16, which is
what decoding batches need. A copy warp (`gl.warp_specialize`) brings each 128-deep k step's packed
words (block_n x 16 int32, one block of `pack_int4`'s layout) and the activations' k step, in
halves of 128 bytes a row, by TMA into a ring of mbarrier-guarded slots. The MMA warps load the
words from shared memory straight into the MMA operand's register layout and turn code j of each
pair of words into a pair of 16-bit values (the Triton generator's inline PTX: PRMT, LOP3 under the
float's exponent, one paired FMA, the group scale multiplied in the same pair), then issue one
asynchronous 16-deep MMA per code position against the matching 16 columns of the activation slot.
Group scales for the next k step are loaded while the current one computes. Split K: programs
sharing a tile store partial tiles, the last one to finish sums them in split order and runs the
op's epilogue.

One function writes each part of the kernel: the tile's place and share of K (`tile_place`), the
rings and barriers (`rings`), the unpacking helpers (`_code_helpers`), the copy warp (`load_steps`),
the MMA warps (`_mma_steps`: the first scales, each k step, the transposed epilogue) and the call
starting both (`partitions`). The start and the epilogue are tile.py's.
"""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.ir.contraction import WARPGROUP_ROWS, extents, gluon_int4_operands, int4_affine, operand_dtype
from flashgen.ir.variants import count
from flashgen.quant import INT4_PERIOD
from flashgen.targets.gluon.emit import NS, PRODUCER_REGS, def_params, grid_dependency
from flashgen.targets.gluon.tile import Tile, epilogue, start
from flashgen.targets.triton.contraction.kernel import tile_order
from flashgen.targets.triton.contraction.ptx import codes_asm
from flashgen.targets.triton.contraction.split_k import merge_splits, split_scratch
from flashgen.targets.triton.emit import KernelSource, Scope
from flashgen.workload import Schedule, Workload

RUN = 16  # consecutive k of one code position of consecutive words: one 16-deep MMA each
COPY_BYTES = 128  # bytes of an activation row per TMA copy (the widest swizzled row)


def _code_helper(operand: str, j: int, scaled: bool) -> tuple[str, list[str]]:
    """A @gluon.jit function giving code j - 8 of a words tile (times its scale when `scaled`) as
    16-bit pairs, two words per PTX statement."""
    name = f"_int4_code{j}_{operand}" + ("_scaled" if scaled else "")
    inputs = ["words", "scale"] if scaled else ["words"]
    constraints = "=r,r,r,r" if scaled else "=r,r,r"
    dt = dtypes.TL[operand].replace("tl.", f"{NS}.")
    return name, ["@gluon.jit", f"def {name}({', '.join(inputs)}):",
                  f'    return {NS}.inline_asm_elementwise("{codes_asm(operand, j, scaled)}", "{constraints}", '
                  f"[{', '.join(inputs)}], dtype={dt}, is_pure=True, pack=2)", "", ""]


def load_steps(parts: int, k_per_col: int) -> list[str]:
    """The copy warp: each k step's weight tile (`k_per_col` k per column: 8 for int32 words, 2 for
    their bytes) and activation parts into a ring slot, refilled once the MMAs that read it hand it back."""
    lines = ["@gluon.jit",
             "def _load_steps(x_desc, w_desc, x_ring, w_ring, ready, free, off_m, off_n, k_lo, k_steps,",
             "                BLOCK_K: gl.constexpr, PART_K: gl.constexpr, STAGES: gl.constexpr):",
             "    # the copy warp: a slot is refilled once the MMAs that read it have handed it back",
             "    for ki in range(k_steps):",
             "        s = ki % STAGES",
             "        mbarrier.wait(free.index(s), ((ki // STAGES) & 1) ^ 1)",
             f"        mbarrier.expect(ready.index(s), {parts} * x_desc.block_type.nbytes + w_desc.block_type.nbytes)",
             "        k = k_lo + ki * BLOCK_K",
             f"        tma.async_copy_global_to_shared(w_desc, [off_n, k // {k_per_col}], ready.index(s), w_ring.index(s))"]
    for p in range(parts):
        lines.append(f"        tma.async_copy_global_to_shared(x_desc, [off_m, k + {p} * PART_K], ready.index(s), "
                     f"x_ring.index(s * {parts} + {p}))")
    return lines + ["", ""]


def _k_range(top: Scope, k_extent: str, split_k: int) -> None:
    """`k_lo`, `k_hi`: the program's share of K, whole k steps spread evenly over the splits, so that
    none is empty (the rules give every split at least two)."""
    if split_k > 1:
        top.line(f"split = {NS}.program_id(2)")
        top.line(f"steps = {NS}.cdiv({k_extent}, BLOCK_K)")
        top.line("k_lo = split * steps // SPLIT_K * BLOCK_K")
        top.line(f"k_hi = {NS}.minimum({k_extent}, (split + 1) * steps // SPLIT_K * BLOCK_K)")
    else:
        top.line("k_lo = 0")
        top.line(f"k_hi = {k_extent}")


def generate_int4(wl: Workload, s: Schedule) -> KernelSource:
    """A W4A16-form workload's Gluon kernel for schedule `s` (sm_90; schedules/contraction_space.py
    `gluon_invalid` says which schedules it takes)."""
    split_k = count(s, "split_k")
    scratch = split_scratch(s["block_m"], s["block_n"], split_k, extents(wl)[3].acc) if split_k > 1 else ()
    consts = {"BLOCK_M": s["block_m"], "BLOCK_N": s["block_n"], "BLOCK_K": s["block_k"], "GROUP_M": count(s, "group_m"),
              "STAGES": s["num_stages"], **({"SPLIT_K": split_k} if split_k > 1 else {})}
    t = start(wl, s, consts, scratch)
    tile_place(t)
    x, word = gluon_int4_operands(wl)
    rings(t, x, word.tensor, byte_view=False)
    # The MMA warps' partition takes every kernel argument, then the ring and the tile's place.
    ring = ["x_ring", "w_ring", "ready", "free", "pid", "off_m", "off_n", "k_lo", "k_hi", "k_steps",
            *(["split"] if split_k > 1 else [])]
    codes, helpers = _code_helpers(t)
    helpers += load_steps(parts(t), 8) + _mma_steps(t, ring, codes)
    partitions(t, ring)
    return KernelSource(t.name, t.module(helpers), t.args, (s["block_m"], s["block_n"]), tile_cols=True,
                        flat=True, grid_z=split_k, scratch=scratch, dialect="gluon")


def operand(t: Tile) -> str:
    """The MMA's operand dtype, in Gluon's names."""
    return dtypes.TL[operand_dtype(t.wl)].replace("tl.", f"{NS}.")


def part_k(t: Tile) -> int:
    """The k of one activation copy: COPY_BYTES of a row, or the whole k step where it is shorter."""
    return min(COPY_BYTES // dtypes.BYTES[operand_dtype(t.wl)], t.s["block_k"])


def parts(t: Tile) -> int:
    """Activation copies per k step."""
    return t.s["block_k"] // part_k(t)


def _scaled(t: Tile) -> bool:
    """Whether the codes have a scale (group or channel) to multiply in while unpacking."""
    return int4_affine(t.wl)[2] is not None


def tile_place(t: Tile) -> None:
    """The wait for the previous kernel, then the program's one tile (numbered as the Triton kernel
    numbers them), its offsets and its share of K, which both partitions read."""
    top = t.top
    grid_dependency(top)
    top.line(f"tiles_m = {NS}.cdiv({t.rows}, BLOCK_M)")
    top.line(f"tiles_n = {NS}.cdiv({t.cols}, BLOCK_N)")
    top.line(f"pid = {NS}.program_id(0)")
    tile_order(top, NS)
    top.line("off_m = pid_m * BLOCK_M")
    top.line("off_n = pid_n * BLOCK_N")
    _k_range(top, t.em.emit(t.con.extent, top), count(t.s, "split_k"))
    top.line(f"k_steps = {NS}.cdiv(k_hi - k_lo, BLOCK_K)")


def rings(t: Tile, x: str, word: str, byte_view: bool) -> None:
    """TMA descriptors and rings of STAGES slots: a slot holds a k step's packed words (never a
    dequantized tile), as int32 words or, with `byte_view`, as their bytes (k / 2 columns), and its
    activations in copies of PART_K k a row; the `ready` and `free` barriers of each slot, initialized
    and fenced before any copy signals one."""
    op, top, x_dt = t.wl.op, t.top, operand(t)
    top.line(f"PART_K: {NS}.constexpr = {part_k(t)}")
    rows, words = (t.em.emit(d, top) for d in op.tensors[word].shape)
    if byte_view:
        dt, cols, shape, row = f"{NS}.int8", "BLOCK_K // 2", f"{rows}, {words} * 4", f"{word}_s0 * 4"
        top.line(f"{word}_bytes = {word}_ptr.to({NS}.pointer_type({NS}.int8), bitcast=True)")
        base = f"{word}_bytes"
    else:
        dt, cols, shape, row, base = f"{NS}.int32", "BLOCK_K // 8", f"{rows}, {words}", f"{word}_s0", f"{word}_ptr"
    x_shape = ", ".join(t.em.emit(d, top) for d in op.tensors[x].shape)
    top.line(f"w_layout: {NS}.constexpr = {NS}.NVMMASharedLayout.get_default_for([BLOCK_N, {cols}], {dt})")
    top.line(f"w_desc = tma.make_tensor_descriptor({base}, shape=[{shape}], strides=[{row}, 1], "
             f"block_shape=[BLOCK_N, {cols}], layout=w_layout)")
    top.line(f"w_ring = {NS}.allocate_shared_memory({dt}, [STAGES, BLOCK_N, {cols}], w_layout)")
    top.line(f"x_layout: {NS}.constexpr = {NS}.NVMMASharedLayout.get_default_for([BLOCK_M, PART_K], {x_dt})")
    top.line(f"x_desc = tma.make_tensor_descriptor({x}_ptr, shape=[{x_shape}], strides=[{x}_s0, 1], "
             "block_shape=[BLOCK_M, PART_K], layout=x_layout)")
    top.line(f"x_ring = {NS}.allocate_shared_memory({x_dt}, [STAGES * {parts(t)}, BLOCK_M, PART_K], x_layout)")
    for bar in ("ready", "free"):
        top.line(f"{bar} = {NS}.allocate_shared_memory({NS}.int64, [STAGES, 1], mbarrier.MBarrierLayout())")
    top.line(f"for i in {NS}.static_range(STAGES):")
    top.line("    mbarrier.init(ready.index(i), count=1)")
    top.line("    mbarrier.init(free.index(i), count=1)")
    top.line("fence_async_shared()  # the barriers are initialized before any copy signals them")


def _code_helpers(t: Tile) -> tuple[list[str], list[str]]:
    """The functions unpacking each code position's run of k (inline PTX), by name, and their source."""
    names: list[str] = []
    lines: list[str] = []
    for j in range(INT4_PERIOD // RUN):
        fn, text = _code_helper(operand_dtype(t.wl), j, _scaled(t))
        names.append(fn)
        lines += text
    return names, lines


def mma_partition(t: Tile, ring: list[str], what: str, mma_k: int, k_width: int, acc: str) -> tuple[list[str], Scope]:
    """The head of the MMA warps' partition `_mma_steps` (what it does: `what`): its signature, the
    warpgroup MMA's layouts (`mma_k` deep, the weight operand `k_width` elements a register) and the
    transposed `acc` accumulator; returns its lines and the scope its body goes on in."""
    lines = ["@gluon.jit", f"def _mma_steps({', '.join(def_params(t.args) + ring)}):", f"    # the MMA warps: {what}",
             f"    mma_layout: {NS}.constexpr = {NS}.NVMMADistributedLayout(version=[3, 0], "
             f"warps_per_cta=[{t.s['num_warps']}, 1], instr_shape=[{WARPGROUP_ROWS}, BLOCK_M, {mma_k}])",
             f"    w_operand: {NS}.constexpr = {NS}.DotOperandLayout(operand_index=0, parent=mma_layout, k_width={k_width})"]
    mma = Scope(lines, "    ", dict(t.top.axes))
    # k_steps > 0 (every split has steps): with no path around the loop, ptxas keeps the MMAs asynchronous
    mma.line(f"{NS}.assume(k_steps > 0)")
    mma.line(f"acc_t = {NS}.zeros([BLOCK_N, BLOCK_M], {dtypes.TL[acc].replace('tl.', NS + '.')}, mma_layout)")
    return lines, mma


def transposed_epilogue(t: Tile, mma: Scope, acc: str) -> None:
    """The op's epilogue in a row-major layout (coalesced stores), the tile transposed back, after the
    splits' merge where K is split."""
    mma.line(f"acc_layout: {NS}.constexpr = {NS}.BlockedLayout([1, 8], [4, 8], [{t.s['num_warps']}, 1], [1, 0])")
    mma.line(f"acc = {NS}.convert_layout({NS}.permute(acc_t, (1, 0)), acc_layout)")
    epilogue(t, merge_splits(mma, "acc", acc, "acc_layout") if count(t.s, "split_k") > 1 else mma, None)


def _mma_steps(t: Tile, ring: list[str], codes: list[str]) -> list[str]:
    """The MMA warps' partition: the transposed tile accumulated over the program's k steps, then the
    op's epilogue."""
    lines, mma = mma_partition(t, ring, "unpack each k step's words into the MMA's register operand, one MMA per "
                               "code position", RUN, 2, "fp32")
    sc_mask = _first_scales(t, mma) if _scaled(t) else None
    mma.line("for ki in range(k_steps):")
    _k_step(t, mma.child(mma.indent + "    "), codes, sc_mask)
    transposed_epilogue(t, mma, t.con.acc)
    return lines + ["", ""]


def _scale_tile(t: Tile, scope: Scope, k: str, sc_mask: str | None) -> str:
    """The group scales of the k step starting at `k`, as [block_n, 1] in the operand dtype."""
    sc = scope.child(axes={"c": ("c_t", sc_mask), "k": (k, None)}, fresh=True)
    return f"({t.em.emit(int4_affine(t.wl)[2], sc)}).to({operand(t)})"


def _first_scales(t: Tile, mma: Scope) -> str | None:
    """The weight rows of the tile in the MMA operand's layout (`c_t`) and the first k step's scales
    `sc`; returns the mask of the scale loads (where a tile runs past the last column)."""
    mma.line(f"c_t = off_n + {NS}.arange(0, BLOCK_N, layout={NS}.SliceLayout(1, w_operand))[:, None]")
    sc_mask = None
    if t.cmask:
        mma.line(f"cmask_t = c_t < {t.cols}")
        sc_mask = "cmask_t"
    mma.line(f"sc = {_scale_tile(t, mma, 'k_lo', sc_mask)}")
    return sc_mask


def _k_step(t: Tile, step: Scope, codes: list[str], sc_mask: str | None) -> None:
    """One k step: wait for its slot, load the words into the operand's registers, unpack and issue the
    MMAs in two halves, and hand the slot back once they are done."""
    scaled = _scaled(t)
    runs, pk, np_ = INT4_PERIOD // RUN, part_k(t), parts(t)
    step.line("s = ki % STAGES")
    if scaled:
        # the next step's scales, loaded while this step computes (the last step reloads its own)
        step.line(f"k_next = {NS}.minimum(k_lo + (ki + 1) * BLOCK_K, k_hi - 1)")
        step.line(f"sc_next = {_scale_tile(t, step, 'k_next', sc_mask)}")
    step.line("mbarrier.wait(ready.index(s), (ki // STAGES) & 1)")
    step.line("words = w_ring.index(s).load(w_operand)")
    if scaled:
        step.line("words, sc_w = gl.broadcast(words, sc)  # each word's row scale")
    # Half of the code positions are unpacked and their MMAs issued, then the other half is unpacked
    # while those run. Every operand register is held until the step's MMAs are all done, and the slot
    # is handed back then: no MMA is in flight across steps (the other programs on the SM fill the gaps).
    for half in (range(runs // 2), range(runs // 2, runs)):
        for j in half:
            step.line(f"w{j} = " + (f"{codes[j]}(words, sc_w)" if scaled else f"{codes[j]}(words)"))
        for j in half:
            part, col = divmod(j * RUN, pk)
            step.line(f"acc_t = warpgroup_mma(w{j}, x_ring.index(s * {np_} + {part}).slice({col}, {RUN}, dim=1)"
                      f".permute((1, 0)), acc_t, is_async=True)")
    held = ", ".join(f"w{j}" for j in range(runs))
    step.line(f"acc_t, {held} = warpgroup_mma_wait(0, deps=[acc_t, {held}])")
    step.line("mbarrier.arrive(free.index(s))")
    if scaled:
        step.line("sc = sc_next")


def partitions(t: Tile, ring: list[str]) -> None:
    """The kernel's `warp_specialize` call: the MMA warps (the default partition) and one copy warp of
    few registers."""
    top = t.top
    top.line(f"{NS}.warp_specialize([")
    top.line(f"    (_mma_steps, ({', '.join([a.name for a in t.args] + ring)})),")
    top.line("    (_load_steps, (x_desc, w_desc, x_ring, w_ring, ready, free, off_m, off_n, k_lo, k_steps, BLOCK_K, "
             "PART_K, STAGES)),")
    top.line(f"], [1], [{PRODUCER_REGS}])")
