# flashgen: gemm_w4a16 (contraction) - y = epilogue(x @ dequant(w_int4).T): 4-bit weights packed 8 per int32 (interleaved, flashgen/quant.py), group or per-channel scales, symmetric or with zero points
# dims: {"G": 128, "K": 4096, "N": 512} (run time: M); attrs: {"act": "none", "dtype": "fp16", "group": "group", "out": "none", "pack": "k128", "with_bias": "no", "with_residual": "no", "zp": "asym"}
# schedule: {"block_k": 1024, "block_m": 2, "block_n": 16, "group_m": 1, "num_stages": 3, "num_warps": 4, "ptx_unpack": 1}
import triton
import triton.language as tl


@triton.jit
def _int4_word_dot(words, x0, x1, x2, x3):
    return tl.inline_asm_elementwise("{ .reg .b32 w, t, acc, one, m1032, sixteenth, m72; .reg .b16 lo, hi; .reg .f32 flo, fhi; mov.b32 one, 0x3c003c00; mov.b32 m1032, 0xe408e408; mov.b32 sixteenth, 0x2c002c00; mov.b32 m72, 0xd480d480; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 t, t, one, m1032; mul.rn.f16x2 acc, t, $2; lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, sixteenth, m72; fma.rn.f16x2 acc, t, $3, acc; shr.b32 w, $1, 8; lop3.b32 t, w, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 t, t, one, m1032; fma.rn.f16x2 acc, t, $4, acc; lop3.b32 t, w, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, sixteenth, m72; fma.rn.f16x2 acc, t, $5, acc; mov.b32 {lo, hi}, acc; cvt.f32.f16 flo, lo; cvt.f32.f16 fhi, hi; add.f32 flo, flo, fhi; mov.b32 $0, flo; }", "=r,r,r,r,r,r", [words, x0, x1, x2, x3], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def gemm_w4a16_kernel(x_ptr, w_packed_ptr, scales_ptr, zeros_ptr, y_ptr, x_s0, w_packed_s0, scales_s0, zeros_s0, y_s0, M, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    rmask = r < M
    c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    acc_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = 0
    k_hi = K
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r0 = pid_m * BLOCK_M + 0
    part0 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    r1 = pid_m * BLOCK_M + 1
    part1 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    rmask_p_r0 = r0 < M
    rmask_p_r1 = r1 < M
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=3):
        kw_w_packed = k0 // 8 + tl.arange(0, BLOCK_K // 8)[:, None]
        words_w_packed = tl.load(w_packed_ptr + c.to(tl.int64) * w_packed_s0 + kw_w_packed)
        kw0 = k0 + tl.arange(0, BLOCK_K // 8)[:, None] // 16 * 128 + tl.arange(0, BLOCK_K // 8)[:, None] % 16
        ka0 = kw0 + 0
        ka1 = kw0 + 16
        ka2 = kw0 + 32
        ka3 = kw0 + 48
        ka4 = kw0 + 64
        ka5 = kw0 + 80
        ka6 = kw0 + 96
        ka7 = kw0 + 112
        t0 = (ka0 // G)
        t1 = tl.load(zeros_ptr + c.to(tl.int64) * zeros_s0 + t0)
        t2 = tl.load(scales_ptr + c.to(tl.int64) * scales_s0 + t0).to(tl.float32)
        rmask0 = r0 < M
        t3 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka0, mask=rmask0, other=0).to(tl.float32)
        xh0 = t3.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t4 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka1, mask=rmask0, other=0).to(tl.float32)
        xh1 = t4.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t5 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka2, mask=rmask0, other=0).to(tl.float32)
        xh2 = t5.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t6 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka3, mask=rmask0, other=0).to(tl.float32)
        xh3 = t6.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t7 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka4, mask=rmask0, other=0).to(tl.float32)
        xh4 = t7.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t8 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka5, mask=rmask0, other=0).to(tl.float32)
        xh5 = t8.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t9 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka6, mask=rmask0, other=0).to(tl.float32)
        xh6 = t9.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t10 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka7, mask=rmask0, other=0).to(tl.float32)
        xh7 = t10.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        xq0 = xh0 | (xh4 << 16)
        xq1 = xh1 | (xh5 << 16)
        xq2 = xh2 | (xh6 << 16)
        xq3 = xh3 | (xh7 << 16)
        xp0 = tl.broadcast_to(xq0, [BLOCK_K // 8, BLOCK_N])
        xp1 = tl.broadcast_to(xq1, [BLOCK_K // 8, BLOCK_N])
        xp2 = tl.broadcast_to(xq2, [BLOCK_K // 8, BLOCK_N])
        xp3 = tl.broadcast_to(xq3, [BLOCK_K // 8, BLOCK_N])
        d0 = _int4_word_dot(words_w_packed, xp0, xp1, xp2, xp3)
        d0 += (8.0 - t1) * (t3.to(tl.float32) + t4.to(tl.float32) + t5.to(tl.float32) + t6.to(tl.float32) + t7.to(tl.float32) + t8.to(tl.float32) + t9.to(tl.float32) + t10.to(tl.float32))
        part0 += d0 * t2
        rmask1 = r1 < M
        t11 = tl.load(x_ptr + r1.to(tl.int64) * x_s0 + ka0, mask=rmask1, other=0).to(tl.float32)
        xh0 = t11.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t12 = tl.load(x_ptr + r1.to(tl.int64) * x_s0 + ka1, mask=rmask1, other=0).to(tl.float32)
        xh1 = t12.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t13 = tl.load(x_ptr + r1.to(tl.int64) * x_s0 + ka2, mask=rmask1, other=0).to(tl.float32)
        xh2 = t13.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t14 = tl.load(x_ptr + r1.to(tl.int64) * x_s0 + ka3, mask=rmask1, other=0).to(tl.float32)
        xh3 = t14.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t15 = tl.load(x_ptr + r1.to(tl.int64) * x_s0 + ka4, mask=rmask1, other=0).to(tl.float32)
        xh4 = t15.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t16 = tl.load(x_ptr + r1.to(tl.int64) * x_s0 + ka5, mask=rmask1, other=0).to(tl.float32)
        xh5 = t16.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t17 = tl.load(x_ptr + r1.to(tl.int64) * x_s0 + ka6, mask=rmask1, other=0).to(tl.float32)
        xh6 = t17.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        t18 = tl.load(x_ptr + r1.to(tl.int64) * x_s0 + ka7, mask=rmask1, other=0).to(tl.float32)
        xh7 = t18.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        xq0 = xh0 | (xh4 << 16)
        xq1 = xh1 | (xh5 << 16)
        xq2 = xh2 | (xh6 << 16)
        xq3 = xh3 | (xh7 << 16)
        xp0 = tl.broadcast_to(xq0, [BLOCK_K // 8, BLOCK_N])
        xp1 = tl.broadcast_to(xq1, [BLOCK_K // 8, BLOCK_N])
        xp2 = tl.broadcast_to(xq2, [BLOCK_K // 8, BLOCK_N])
        xp3 = tl.broadcast_to(xq3, [BLOCK_K // 8, BLOCK_N])
        d1 = _int4_word_dot(words_w_packed, xp0, xp1, xp2, xp3)
        d1 += (8.0 - t1) * (t11.to(tl.float32) + t12.to(tl.float32) + t13.to(tl.float32) + t14.to(tl.float32) + t15.to(tl.float32) + t16.to(tl.float32) + t17.to(tl.float32) + t18.to(tl.float32))
        part1 += d1 * t2
    row_ids = tl.arange(0, BLOCK_M)[:, None]
    acc_acc = tl.where(row_ids == 0, (tl.sum(part0, axis=0))[None, :], acc_acc)
    acc_acc = tl.where(row_ids == 1, (tl.sum(part1, axis=0))[None, :], acc_acc)
    tl.store(y_ptr + r.to(tl.int64) * y_s0 + c, acc_acc.to(tl.float16), mask=rmask)
