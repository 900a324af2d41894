"""Inline PTX of the int4 unpacking strategies, each emitted once per generated module as a named
@triton.jit function (Triton inlines it at every call), called by name from the kernel.

Constants: a 16-bit float with INT4_MAGIC's bits holds a 4-bit code exactly in its low mantissa
bits; PAIR gives per 16-bit float the PTX type, 1.0 and -(magic + 8) as pairs of 16-bit values."""
from __future__ import annotations

from flashgen.ir import dtypes
from flashgen.targets.triton.contraction.context import Tile

# A 16-bit float's bits, and its value, whose low mantissa bits hold a 4-bit code exactly.
INT4_MAGIC = {"bf16": (0x4300, 128.0), "fp16": (0x6400, 1024.0)}
# The 16-bit float codes are unpacked in, per operand dtype: e4m3 codes come as fp16 (u - 8 is exact
# in both) and are converted, two per instruction.
UNPACK_FLOAT = {"bf16": "bf16", "fp16": "fp16", "fp8e4m3": "fp16"}
# Per 16-bit float: the PTX type, 1.0 and -(magic + 8) as a pair of 16-bit values.
PAIR = {"bf16": ("bf16x2", 0x3F803F80, 0xC308C308), "fp16": ("f16x2", 0x3C003C00, 0xE408E408)}
# fp16 pairs: 1.0, -(1024 + 8), 1/16 and -(64 + 8). A code under 0x6400 reads 1024 + code (or, four bits
# up, 1024 + 16 * code).
F16 = {"one": 0x3C003C00, "m1032": 0xE408E408, "sixteenth": 0x2C002C00, "m72": 0xD480D480}
# (x_j, x_j+4) in one fp16 pair: one conversion of both fp32 values (x_j in the low half)
X_PAIR_PTX = "cvt.rn.f16x2.f32 $0, $2, $1;"


def _function(name: str, params: list[str], asm: str, constraints: str, dtype: str, pack: int) -> str:
    """A @triton.jit function of one elementwise inline-PTX statement."""
    args = ", ".join(params)
    return (f"@triton.jit\ndef {name}({args}):\n"
            f"    return tl.inline_asm_elementwise(\"{asm}\", \"{constraints}\", [{args}], dtype={dtype}, "
            f"is_pure=True, pack={pack})\n")


def codes_asm(operand: str, j: int, scaled: bool = False) -> str:
    """Inline PTX for code j - 8 of two words at once (`pack=2`: the two 16-bit results share a
    register): PRMT gathers the half-words holding code j of both words, a shift and one LOP3 put each
    code under the 16-bit float's exponent, one paired FMA subtracts magic + 8. `scaled`
    (`operand_scale`): the pair is then multiplied by the rows' group scale in the same 16-bit float
    ($3: the two words' scales, one 16-bit pair, as both words lie in one row), so that the matrix
    instruction accumulates every group into one tile."""
    kind, one, minus = PAIR[operand]
    magic = INT4_MAGIC[operand][0]
    shift = f"shr.b32 t, t, {4 * (j % 4)}; " if j % 4 else ""
    scale = ""
    if scaled:  # bf16x2 has no mul before sm_90: an FMA adding -0
        scale = (" mul.rn.f16x2 $0, t, $3;" if operand == "fp16"
                 else " mov.b32 z, 0x80008000; fma.rn.bf16x2 $0, t, $3, z;")
    return (f"{{ .reg .b32 {'z, ' if scaled else ''}t, one, minus; "
            f"prmt.b32 t, $1, $2, {0x5410 if j < 4 else 0x7632:#x}; {shift}"
            f"lop3.b32 t, t, 0x000F000F, {magic << 16 | magic:#x}, 0xEA; "
            f"mov.b32 one, {one:#x}; mov.b32 minus, {minus:#x}; fma.rn.{kind} {'t' if scaled else '$0'}, t, one, minus;"
            f"{scale} }}")


def _dot_asm(words: int) -> str:
    """Inline PTX for the dot of `words` words' eight int4 codes each (minus 8) with their x values, in
    fp16 pairs: each AND-OR puts codes j and j + 4 (bits 4j and 4j + 16) under fp16 exponents, one
    paired FMA subtracts 8, one paired FMA multiplies by (x_j, x_j+4) and adds; all paired products sum
    in one fp16 pair, whose halves are summed in fp32. A product rounds to 11 bits, as a 16-bit dot
    product's would. $1..$words are the words, $(words + 1 + 4 i + q) word i's x pair q."""
    c = F16
    lines = [".reg .b32 w, t, acc, one, m1032, sixteenth, m72;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi;",
             f"mov.b32 one, {c['one']:#x};", f"mov.b32 m1032, {c['m1032']:#x};",
             f"mov.b32 sixteenth, {c['sixteenth']:#x};", f"mov.b32 m72, {c['m72']:#x};"]
    for i in range(words):
        for q in range(4):
            src = f"${1 + i}" if q < 2 else "w"
            if q == 2:
                lines.append(f"shr.b32 w, ${1 + i}, 8;")
            if q % 2 == 0:  # codes q, q + 4 in bits 0-3 of each half
                lines.append(f"lop3.b32 t, {src}, 0x000F000F, 0x64006400, 0xEA;")
                lines.append("fma.rn.f16x2 t, t, one, m1032;")
            else:  # codes in bits 4-7 of each half: 1024 + 16 * code
                lines.append(f"lop3.b32 t, {src}, 0x00F000F0, 0x64006400, 0xEA;")
                lines.append("fma.rn.f16x2 t, t, sixteenth, m72;")
            x = f"${words + 1 + 4 * i + q}"
            lines.append(f"mul.rn.f16x2 acc, t, {x};" if i == q == 0 else f"fma.rn.f16x2 acc, t, {x}, acc;")
    lines += ["mov.b32 {lo, hi}, acc;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.f32 flo, flo, fhi;",
              "mov.b32 $0, flo;"]
    return "{ " + " ".join(lines) + " }"


def codes(t: Tile, j: int, scaled: bool = False) -> str:
    """The helper giving code j - 8 of a words tile as 16-bit floats (`UNPACK_FLOAT` of the operand;
    times the scale when `scaled`)."""
    unpack = UNPACK_FLOAT[t.operand]
    name = f"_int4_code{j}_{unpack}" + ("_scaled" if scaled else "")
    params = ["words", "scale"] if scaled else ["words"]
    return t.helper(name, _function(name, params, codes_asm(unpack, j, scaled), "=r,r,r,r" if scaled else "=r,r,r",
                                    dtypes.TL[unpack], 2))


def word_dot(t: Tile) -> str:
    """The helper for the fp32 dot of a words tile's eight codes with four x pairs (`_int4_pair_terms`)."""
    params = ["words", "x0", "x1", "x2", "x3"]
    return t.helper("_int4_word_dot", _function("_int4_word_dot", params, _dot_asm(1), "=r,r,r,r,r,r", "tl.float32", 1))


def quad_dot(t: Tile) -> str:
    """The helper for the fp32 dot of four words tiles' codes with their x pairs (`_int4_quad_terms`):
    one conversion and one scale per four words instead of per word."""
    params = [f"w{i}" for i in range(4)] + [f"x{i}_{q}" for i in range(4) for q in range(4)]
    return t.helper("_int4_quad_dot", _function("_int4_quad_dot", params, _dot_asm(4), ",".join(["=r"] + ["r"] * 20),
                                               "tl.float32", 1))


def x_pair(t: Tile) -> str:
    """The helper packing two fp32 tiles into fp16 pairs (x_j low) in int32 lanes."""
    return t.helper("_x_pair", _function("_x_pair", ["lo", "hi"], X_PAIR_PTX, "=r,f,f", "tl.int32", 1))
