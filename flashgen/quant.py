"""Weight quantization and packing, done once, offline, before a quantized GEMM runs.

- `quantize_rtn`: round-to-nearest quantization of a float weight [N, K] (nn.Linear layout) to 4 or 8
  bits, per output channel or per group of `group` consecutive k, symmetric or with zero points.
  Codes are unsigned for 4 bits (w ~ (u - zero) * scale, u in [0, 15]; symmetric means zero = 8) and
  signed for 8 bits (w ~ q * scale, q in [-127, 127]).
- `quantize_gptq`: the same codes grid chosen by GPTQ, which spreads each column's rounding error over
  the columns after it so that the layer's output on calibration inputs moves least (the
  `flashgen quantize` command's: runtime/checkpoints/gptq_quantize.py).
- `pack_int4` / `unpack_int4`: eight 4-bit codes per int32, interleaved over blocks of INT4_PERIOD = 128
  k: word 16*b + i holds, in bits 4j..4j+3, the code of k = 128*b + 16*j + i. Code j of sixteen
  consecutive words is then a run of sixteen consecutive k, which a matrix tile multiplies by sixteen
  consecutive columns of x: the words are unpacked in the operand layout of the matrix instruction,
  never reshaped (targets/triton/contraction.py). K is padded with zero codes to a multiple of 128.
  This is the layout the generated W4A16 kernels read.
- `pack_int4_lanes` / `unpack_int4_lanes`: gemm_w4a8's `lanes` layout. Each code is stored as the signed
  nibble u - 8 (4-bit two's complement), eight per int32, over blocks of LANE_BLOCK = 32 k: word 4*b + t
  holds k = 32*b + 4*t + i in the high nibble of byte i and k = 32*b + 16 + 4*t + i in its low nibble.
  One AND with 0xF0F0F0F0 then yields four int8 lanes (u - 8) * 16 of four consecutive k, and a shift
  by 4 and the same AND the four k sixteen further on: the k order in which a thread holds an int8
  matrix instruction's operand (k = 4t..4t+3 and 16+4t..16+4t+3 of each 32). Padding codes (K padded to
  a multiple of INT4_PERIOD, as `pack_int4`'s) are zero nibbles, whose products vanish.
- `quantize_w4a8`: 4-bit codes whose products with int8 activations stay exact on int8 tensor cores:
  w ~ (u - 8) * s_group * s_channel with s_group an integer in 1..16, so that (u - 8) * s_group lies in
  [-128, 112], an int8, and an int8 x int8 matrix instruction sums it exactly in int32; the fp32
  per-channel scale applies once, to the sum (gemm_w4a8).
- `quantize_fp8`: e4m3 values with one fp32 scale per output channel (amax / 448), the weights of
  gemm_fp8.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashgen.lazy import lazy

torch = lazy("torch")

from flashgen.errors import FlashgenError


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor          # [N, K]: uint8 codes (4 bits) or int8 values (8 bits)
    scales: torch.Tensor         # [N, K // group] float32
    zeros: torch.Tensor | None   # [N, K // group] uint8 zero points (4 bits, asymmetric), else None
    bits: int
    group: int                   # k per scale; K for per-channel

    def dequantize(self) -> torch.Tensor:
        """The float64 weight the quantized kernels compute with."""
        s = self.scales.to(torch.float64).repeat_interleave(self.group, dim=1)
        q = self.codes.to(torch.float64)
        if self.bits == 4:
            z = (self.zeros.to(torch.float64) if self.zeros is not None
                 else torch.full_like(self.scales, 8, dtype=torch.float64)).repeat_interleave(self.group, dim=1)
            q = q - z
        return q * s


def _check(w: torch.Tensor, bits: int, group: int | None, symmetric: bool) -> int:
    """The group of a weight [N, K] to be quantized, after refusing what no quantizer here makes."""
    if w.dim() != 2:
        raise FlashgenError(f"a weight must be [N, K], got shape {tuple(w.shape)}")
    k = w.shape[1]
    g = k if group is None else group
    if bits not in (4, 8):
        raise FlashgenError(f"bits must be 4 or 8, got {bits}")
    if k % g:
        raise FlashgenError(f"K={k} is not a multiple of the group size {g}")
    if bits == 8 and not symmetric:
        raise FlashgenError("8-bit weights are symmetric")
    return g


def _grid(wg: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each group's scale and zero point (None: symmetric) from its float64 weights [..., G]: symmetric
    steps of amax / qmax, else the group's range in 15 steps with a rounded zero point."""
    if symmetric:
        return wg.abs().amax(-1).clamp_min(1e-12) / wg.new_tensor(7.0 if bits == 4 else 127.0), None
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / wg.new_tensor(15.0)).clamp_min(1e-12)
    return scale, torch.round(-lo / scale).clamp(0, 15)


def _round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Float64 weights' codes on the grid (scale and zero broadcast against w): unsigned 0..15 for 4 bits
    (symmetric: zero point 8), signed -127..127 for 8 bits."""
    if zero is not None:
        return torch.round(w / scale + zero).clamp(0, 15)
    qmax = 7.0 if bits == 4 else 127.0
    q = torch.round(w / scale).clamp(-qmax - (bits == 4), qmax)
    return q + 8 if bits == 4 else q


def _value(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The float64 weight that codes `_round` gave stand for."""
    return (q - (zero if zero is not None else 8.0 if bits == 4 else 0.0)) * scale


def _codes_dtype(bits: int) -> torch.dtype:
    return torch.uint8 if bits == 4 else torch.int8


def quantize_rtn(w: torch.Tensor, bits: int, group: int | None = None, symmetric: bool = True) -> QuantizedWeight:
    g = _check(w, bits, group, symmetric)
    n, k = w.shape
    wg = w.to(torch.float64).reshape(n, k // g, g)
    # CUDA divides by a Python number as a product with its reciprocal, an ulp off the CPU's quotient,
    # which flips codes at ties: divide by a tensor, so a weight quantizes alike wherever it lies.
    scale, zero = _grid(wg, bits, symmetric)
    q = _round(wg, scale[..., None], None if zero is None else zero[..., None], bits)
    return QuantizedWeight(q.to(_codes_dtype(bits)).reshape(n, k), scale.float(),
                           None if zero is None else zero.to(torch.uint8), bits, g)


def quantize_gptq(w: torch.Tensor, hessian: torch.Tensor, bits: int, group: int | None = None,
                  symmetric: bool = True, damp: float = 0.01, scale_dtype: torch.dtype | None = None,
                  block: int = 128) -> QuantizedWeight:
    """GPTQ (Frantar et al., 2022): `quantize_rtn`'s codes grid, the columns quantized in k order, each
    column's rounding error spread over the columns still to come so as to keep the layer's output on
    its calibration inputs, whose `hessian` [K, K] is 2 X X^T / n. It is dampened by `damp` times its
    mean diagonal; its inverse's upper Cholesky factor U gives each column's update: the error divided
    by U's diagonal entry, times U's row. Columns go in blocks of `block`, the later blocks updated once
    per block; a group's scale and zero point come from its columns as they stand when the group
    starts (rounded to `scale_dtype`, the dtype they are stored in, float32 if None, before any code is
    chosen)."""
    scale_dtype = scale_dtype or torch.float32
    g = _check(w, bits, group, symmetric)
    n, k = w.shape
    if hessian.shape != (k, k):
        raise FlashgenError(f"the Hessian must be [{k}, {k}] for a weight of K={k}, got {tuple(hessian.shape)}")
    W, H = w.to(torch.float64).clone(), hessian.to(torch.float64).clone()
    dead = H.diagonal() == 0  # (inputs always zero: their columns do not matter)
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H.diagonal().add_(damp * H.diagonal().mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.empty(n, k, dtype=torch.float64)
    scales = torch.empty(n, k // g, dtype=torch.float64)
    zeros = None if symmetric else torch.empty(n, k // g, dtype=torch.float64)
    block = g * max(1, block // g) if g < k else block  # (a group lies within one block: its columns current)
    tiny = torch.finfo(scale_dtype).tiny
    threads = torch.get_num_threads()
    # The loop's ops are small (a column of N values each), and torch's threads wait on each other after
    # every one: with one of 2 cores busy elsewhere, a [3072, 576] weight took 13.7 s on 2 threads and
    # 1.2 s on one. One thread here; the caller's count after.
    torch.set_num_threads(1)
    try:
        _gptq_columns(W, U, codes, scales, zeros, bits, g, block, scale_dtype, tiny)
    finally:
        torch.set_num_threads(threads)
    return QuantizedWeight(codes.to(_codes_dtype(bits)), scales.float(),
                           None if zeros is None else zeros.to(torch.uint8), bits, g)


def _gptq_columns(W: torch.Tensor, U: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None, bits: int, g: int, block: int, scale_dtype: torch.dtype,
                  tiny: float) -> None:
    """`quantize_gptq`'s column loop, filling codes, scales and zeros in place (W is updated as it goes)."""
    n, k = W.shape
    symmetric = zeros is None
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        err = torch.empty(n, b1 - b0, dtype=torch.float64)
        for c in range(b0, b1):
            if c % g == 0:
                scale, zero = _grid(W[:, c:c + g], bits, symmetric)
                scales[:, c // g] = scale.to(scale_dtype).clamp_min(tiny).to(torch.float64)
                if zeros is not None:
                    zeros[:, c // g] = zero
            s, z = scales[:, c // g], None if zeros is None else zeros[:, c // g]
            codes[:, c] = _round(W[:, c], s, z, bits)
            e = (W[:, c] - _value(codes[:, c], s, z, bits)) / U[c, c]
            W[:, c:b1] -= e[:, None] * U[c, c:b1][None, :]
            err[:, c - b0] = e
        W[:, b1:] -= err @ U[b0:b1, b1:]


W4A8_GROUP_MAX = 16  # (u - 8) * s_group stays within int8 for s_group <= 16


@dataclass(frozen=True)
class W4A8Weight:
    codes: torch.Tensor                # [N, K] uint8 codes in 0..15 (zero point 8)
    channel_scales: torch.Tensor       # [N] float32
    group_scales: torch.Tensor | None  # [N, K // group] int8 in 1..W4A8_GROUP_MAX, or None per channel
    group: int                         # k per group scale; K for per-channel

    def operand(self) -> torch.Tensor:
        """The int8 operand [N, K] of the matrix instruction: (u - 8) * s_group."""
        q = self.codes.to(torch.int16) - 8
        if self.group_scales is not None:
            q = q * self.group_scales.to(torch.int16).repeat_interleave(self.group, dim=1)
        return q.to(torch.int8)

    def dequantize(self) -> torch.Tensor:
        """The float64 weight gemm_w4a8 computes with."""
        return self.operand().to(torch.float64) * self.channel_scales.to(torch.float64)[:, None]


def quantize_w4a8(w: torch.Tensor, group: int | None = None) -> W4A8Weight:
    """Round-to-nearest W4A8 weights. Per channel (`group` None or K): u - 8 = round(w / s), s = amax / 7.
    In groups: s_channel = amax of the row / (7 * 16), each group's integer s_group = ceil(amax of the
    group / (7 * s_channel)) in 1..16, and u - 8 = round(w / (s_channel * s_group)) in -8..7: a group's
    step is at most its W4A16 step rounded up to a multiple of s_channel."""
    if w.dim() != 2:
        raise FlashgenError(f"a weight must be [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    g = k if group is None else group
    if g <= 0 or k % g:
        raise FlashgenError(f"K={k} is not a multiple of the group size {g}")
    wf = w.to(torch.float64)
    if g == k:
        s = wf.abs().amax(-1).clamp_min(1e-12) / wf.new_tensor(7.0)
        q = torch.round(wf / s[:, None]).clamp(-8, 7)
        return W4A8Weight((q + 8).to(torch.uint8), s.float(), None, k)
    wg = wf.reshape(n, k // g, g)
    s = (wf.abs().amax(-1).clamp_min(1e-12) / wf.new_tensor(7.0 * W4A8_GROUP_MAX)).float().to(torch.float64)
    sg = torch.ceil(wg.abs().amax(-1) / (7.0 * s[:, None])).clamp(1, W4A8_GROUP_MAX)
    q = torch.round(wg / (s[:, None, None] * sg[..., None])).clamp(-8, 7)
    return W4A8Weight((q + 8).to(torch.uint8).reshape(n, k), s.float(), sg.to(torch.int8), g)


@dataclass(frozen=True)
class Fp8Weight:
    values: torch.Tensor  # [N, K] float8_e4m3fn
    scales: torch.Tensor  # [N] float32

    def dequantize(self) -> torch.Tensor:
        """The float64 weight gemm_fp8 computes with."""
        return self.values.to(torch.float64) * self.scales.to(torch.float64)[:, None]


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per-channel e4m3 weights: s = amax of the row / 448 (e4m3's largest finite value), values w / s
    rounded to nearest by the cast."""
    if w.dim() != 2:
        raise FlashgenError(f"a weight must be [N, K], got shape {tuple(w.shape)}")
    wf = w.to(torch.float64)
    s = (wf.abs().amax(-1).clamp_min(1e-12) / wf.new_tensor(448.0)).float().to(torch.float64)
    return Fp8Weight((wf / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), s.float())


INT4_PERIOD = 128  # k per block of sixteen interleaved words


def packed_words(k):
    """Words per row of a packed [N, K] int4 weight (K padded to a multiple of INT4_PERIOD): of an int,
    or of an IR dim expression (the op's tensor shape)."""
    return (k + INT4_PERIOD - 1) // INT4_PERIOD * (INT4_PERIOD // 8)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in 0..15 -> [N, packed_words(K)] int32 in the interleaved layout."""
    n, k = codes.shape
    _check_codes(codes)
    padded = torch.zeros(n, packed_words(k) * 8, dtype=torch.int64, device=codes.device)
    padded[:, :k] = codes.to(torch.int64)
    c = padded.reshape(n, -1, 8, INT4_PERIOD // 8)  # [n, block, j, i]
    word = torch.zeros(n, c.shape[1], INT4_PERIOD // 8, dtype=torch.int64, device=codes.device)
    for j in range(8):
        word |= c[:, :, j, :] << (4 * j)
    return _as_int32(word.reshape(n, -1))


def _check_codes(codes: torch.Tensor) -> None:
    if codes.numel() and not codes.is_meta and (codes.min() < 0 or codes.max() > 15):  # (meta: no values)
        raise FlashgenError("4-bit codes must lie in 0..15")


def _words(packed: torch.Tensor, k: int) -> torch.Tensor:
    """A packed [N, words] int32 tensor's words as int64 in 0..2^32-1, after checking its width."""
    words = packed.shape[1]
    if words != packed_words(k):
        raise FlashgenError(f"{words} words per row do not pack K={k} (expected {packed_words(k)})")
    return packed.to(torch.int64) & 0xFFFFFFFF


def _as_int32(word: torch.Tensor) -> torch.Tensor:
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The [N, k] codes of `pack_int4`'s output (its padding dropped)."""
    n = packed.shape[0]
    word = _words(packed, k).reshape(n, -1, INT4_PERIOD // 8)
    codes = torch.stack([(word >> (4 * j)) & 15 for j in range(8)], dim=2)  # [n, block, j, i]
    return codes.reshape(n, -1)[:, :k].to(torch.uint8)


LANE_BLOCK = 32  # k per block of four `lanes` words: one k step of an int8 matrix instruction
LANE_MASK = 0xF0F0F0F0  # the high nibble of each byte: four int8 lanes (u - 8) * 16


def pack_int4_lanes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in 0..15 -> [N, packed_words(K)] int32 in the `lanes` layout (signed nibbles u - 8)."""
    n, k = codes.shape
    _check_codes(codes)
    padded = torch.zeros(n, packed_words(k) * 8, dtype=torch.int64, device=codes.device)
    padded[:, :k] = (codes.to(torch.int64) - 8) & 15
    c = padded.reshape(n, -1, 2, 4, 4)  # [n, block, h, t, i]: k = 32 * block + 16 * h + 4 * t + i
    word = torch.zeros(n, c.shape[1], 4, dtype=torch.int64, device=codes.device)
    for i in range(4):
        word |= (c[:, :, 0, :, i] << (8 * i + 4)) | (c[:, :, 1, :, i] << (8 * i))
    return _as_int32(word.reshape(n, -1))


def unpack_int4_lanes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The [N, k] codes (0..15) of `pack_int4_lanes`' output (its padding dropped)."""
    n = packed.shape[0]
    word = _words(packed, k).reshape(n, -1, 1, 4, 1)  # [n, block, h, t, i]
    shift = 8 * torch.arange(4, device=packed.device).reshape(1, 1, 1, 1, 4) + 4 * (1 - torch.arange(2, device=packed.device)).reshape(1, 1, 2, 1, 1)
    nibble = (word >> shift) & 15
    return ((nibble ^ 8).reshape(n, -1)[:, :k]).to(torch.uint8)  # u = (u - 8) + 8: the sign bit flipped


PACKS = {"k128": (pack_int4, unpack_int4), "lanes": (pack_int4_lanes, unpack_int4_lanes)}  # by the ops' `pack` attr
