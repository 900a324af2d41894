"""Triton code generation for the contraction class: GEMMs with fused prologues and epilogues.

One program computes a block_m x block_n tile of the output (kernel.py: the tile walk, a split's k
range, the epilogue). Tiles are numbered along one grid axis and grouped `group_m` row-tiles at a
time, so that programs running together share weight tiles in the L2. For tiles of 16 rows or more,
the k loop loads an A tile [block_m, block_k] and a B tile [block_k, block_n] through the op's
prologue expressions (operands.py: unpacking, dequantization), casts both to the operand dtype and
accumulates `tl.dot` in fp32 (or int32 for int8 operands; mma.py); int4 weights are unpacked into the
matrix instruction's register operand instead (int4_mma.py). Tiles of fewer rows are GEMVs on the
ALUs (gemv.py; int4 codes per element or in inline-PTX fp16 pairs, int4_gemv.py, ptx.py). With
`split_k`, a third grid axis shares each tile's k range, and the last split to finish merges
(split_k.py). With `persistent`, a fixed number of programs per SM walk the tiles in turn. With `tma`
(sm_90, operands without a prologue), TMA descriptors copy the A and W tiles. Statements before the
Contract (a fused norm's sum of squares and inverse root) are a row pass (row_pass.py): matrix tiles
run it over K before their k loop, unsplit GEMV tiles fold it into theirs.
"""
from flashgen.targets.triton.contraction.kernel import generate_contraction
from flashgen.targets.triton.contraction.row_pass import row_factors

__all__ = ["generate_contraction", "row_factors"]
