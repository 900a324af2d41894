"""The k loop of a matrix tile: A and W tiles through their prologues (or copied by TMA), `tl.dot`."""
from __future__ import annotations

from flashgen.targets.triton.contraction.context import ACC, Tile
from flashgen.targets.triton.contraction.operands import b_tile_values, operand_tile


def tma_k_loop(t: Tile, tensors: tuple[str, str]) -> None:
    """The k loop of a tile whose A and W tiles TMA descriptors copy (built on the device, in global
    scratch the launcher provides): no address arithmetic or masks per thread, zeros past the edges."""
    em, top = t.em, t.top
    for name, rows, block in zip(tensors, ("pid_m * BLOCK_M", "pid_n * BLOCK_N"), ("BLOCK_M", "BLOCK_N")):
        shape = ", ".join(em.emit(d, top) for d in em.op.tensors[name].shape)
        top.line(f"{name}_desc = tl.make_tensor_descriptor({name}_ptr, shape=[{shape}], strides=[{name}_s0, 1], "
                 f"block_shape=[{block}, BLOCK_K])")
    top.line("for k0 in range(k_lo, k_hi, BLOCK_K):")
    a, b = tensors
    t.body.line(f"{t.acc} = tl.dot({a}_desc.load([pid_m * BLOCK_M, k0]), {b}_desc.load([pid_n * BLOCK_N, k0]).T, "
                f"{t.acc}, out_dtype={ACC[t.con.acc]})")


def k_loop(t: Tile) -> None:
    """The k loop of a tile: A and B tiles through their prologues, then `tl.dot`."""
    t.top.line("for k0 in range(k_lo, k_hi, BLOCK_K):")
    a_scope = t.body.child(axes={"r": ("r", "rmask"), "k": ("ka", "kmask_a" if t.kmask else None)}, fresh=True)
    a_scope.line("ka = k0 + tl.arange(0, BLOCK_K)[None, :]")
    if t.kmask:
        a_scope.line(f"kmask_a = ka < {t.em.emit(t.con.extent, a_scope)}")
    b_tile_values(t, t.body)
    tiles = [operand_tile(t, e, scope) for e, scope in ((t.con.a, a_scope), (t.b_expr, t.body))]
    t.body.line(f"{t.acc} = tl.dot({tiles[0]}, {tiles[1]}, {t.acc}, out_dtype={ACC[t.con.acc]})")
