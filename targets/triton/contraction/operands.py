"""A k step's operand tiles through the op's prologue: the weight tile's packed int4 words, its codes
unpacked per element into fp32, its group rows, and operand tiles cast to the operand dtype."""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.ir import expr as E
from flashgen.ir import prologue
from flashgen.quant import INT4_PERIOD
from flashgen.targets.triton.contraction.context import Tile
from flashgen.targets.triton.contraction.ptx import INT4_MAGIC
from flashgen.targets.triton.emit import Emitter, Scope

MAGIC = 8388608.0  # 2^23: an fp32 with 2^23's exponent holds a small integer in its low mantissa bits
RUN = prologue.RUN


def operand_tile(t: Tile, e: E.Expr, scope: Scope) -> str:
    """An operand tile of a matrix instruction, loaded in the operand dtype when it is stored in it."""
    return t.em.operand(e, scope, t.operand)


def load_words(t: Tile, scope: Scope, word: E.Load, var: str | None = None) -> str:
    """Load the tile's packed words once, [block_k / 8, block_n], at the row indices of `word` (the
    scope's columns, and an expert's index for the moe class's stacked weights), into `var`
    (`words_<tensor>` unless given)."""
    em, name = t.em, word.tensor
    var = var or f"words_{name}"
    scope.line(f"kw_{name} = k0 // 8 + tl.arange(0, BLOCK_K // 8)[:, None]")
    bound = f"(kw_{name} < {em.emit(em.op.tensors[name].shape[-1], scope)})" if t.kmask else None
    tile = E.Load(name, (*word.indices[:-1], E.Index("kw")))
    scope.line(f"{var} = {em.load(tile, scope.child(axes={**scope.axes, 'kw': (f'kw_{name}', bound)}, fresh=True))}")
    return var


def _unpack_int4(t: Tile, scope: Scope, word: E.Load, var: str) -> None:
    """Unpack all eight codes of each of the tile's words into a [block_k, block_n] tile in k order:
    int32 for an integer operand (the codes stay exact through its integer prologue), the 16-bit
    float of a 16-bit operand (codes and their differences with a zero point are exact in it, and a
    float scale promotes them to fp32), else fp32 values (they only ever meet the float
    dequantization arithmetic)."""
    words = load_words(t, scope, word, "words" + var.removeprefix("codes"))
    split = (f"(tl.reshape({words}, [BLOCK_K // {INT4_PERIOD}, 1, {RUN}, BLOCK_N]) "
             f">> (tl.arange(0, 8) * 4)[None, :, None, None]) & 15")
    if not dtypes.is_float(t.operand):
        scope.line(f"{var} = tl.reshape({split}, [BLOCK_K, BLOCK_N])")
        t.em.named[var] = var
        return
    if t.operand in INT4_MAGIC:  # under the 16-bit float's exponent (1024 or 128 + code), less that: two 16-bit ops
        bits, base = INT4_MAGIC[t.operand]
        scope.line(f"{var} = tl.reshape(({split}) | {bits}, [BLOCK_K, BLOCK_N]).to(tl.int16)"
                   f".to({dtypes.TL[t.operand]}, bitcast=True) - {base}")
        t.em.named[var] = var
        return
    # Codes become exact fp32 values without an int-to-float conversion (a quarter-rate instruction):
    # 2^23 + code has the code in its low mantissa bits, so OR in 2^23's exponent and subtract 2^23.
    scope.line(f"{var} = tl.reshape(({split}) | 0x4B000000, [BLOCK_K, BLOCK_N]).to(tl.float32, bitcast=True) - {MAGIC}")
    t.em.named[var] = var


def _group_rows(em: Emitter, scope: Scope, load: E.Load, var: str, k_extent: E.Expr | None) -> None:
    """Load the tile's block_k / G group rows of a [row, k // G] tensor once and repeat each G times:
    the load runs with k standing for the first k of each group."""
    g = em.emit(load.indices[-1].b, scope)
    kg = f"kg_{load.tensor}"
    scope.line(f"{kg} = k0 + (tl.arange(0, BLOCK_K // {g}) * {g})[:, None]")
    mask = f"{kg}_mask" if k_extent is not None else None
    if mask:
        scope.line(f"{mask} = {kg} < {em.emit(k_extent, scope)}")
    rows = em.emit(load, scope.child(axes={**scope.axes, "k": (kg, mask)}, fresh=True))
    scope.line(f"{var} = tl.reshape(tl.broadcast_to({rows}[:, None, :], [BLOCK_K // {g}, {g}, BLOCK_N]), "
               "[BLOCK_K, BLOCK_N])")
    em.named[var] = var


def b_tile_values(t: Tile, b_scope: Scope) -> None:
    """A k step's [block_k, block_n] indices of the weight tile, then `unpacked_values`."""
    b_scope.line("kb = k0 + tl.arange(0, BLOCK_K)[:, None]")
    if t.kmask:
        b_scope.line(f"kmask_b = kb < {t.em.emit(t.con.extent, b_scope)}")
    unpacked_values(t, b_scope)


def unpacked_values(t: Tile, b_scope: Scope) -> None:
    """A k step's unpacked int4 codes and group rows of the weight tile, [block_k, block_n] each
    (what the rewritten prologue refers to: `t.unpacked`, `t.grouped`)."""
    for word, var in t.unpacked.items():
        _unpack_int4(t, b_scope, word, var)
    for load, var in t.grouped.items():
        _group_rows(t.em, b_scope, load, var, t.con.extent if t.kmask else None)
