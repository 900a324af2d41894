# flashgen: gemm_w4a16 (contraction) - y = epilogue(x @ dequant(w_int4).T): 4-bit weights packed 8 per int32 (interleaved, flashgen/quant.py), group or per-channel scales, symmetric or with zero points
# dims: {"G": 128, "K": 4096, "N": 4096} (run time: M); attrs: {"act": "none", "dtype": "bf16", "group": "group", "out": "none", "pack": "k128", "with_bias": "no", "with_residual": "no", "zp": "sym"}
# schedule: {"block_k": 2048, "block_m": 1, "block_n": 16, "early_load": 0, "group_m": 1, "num_stages": 1, "num_warps": 4, "operand_scale": 0, "persistent": 0, "ptx_unpack": 2, "split_k": 1, "tma": 0}
import triton
import triton.language as tl


@triton.jit
def _x_pair(lo, hi):
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _int4_quad_dot(w0, w1, w2, w3, x0_0, x0_1, x0_2, x0_3, x1_0, x1_1, x1_2, x1_3, x2_0, x2_1, x2_2, x2_3, x3_0, x3_1, x3_2, x3_3):
    return tl.inline_asm_elementwise("{ .reg .b32 w, t, acc, one, m1032, sixteenth, m72; .reg .b16 lo, hi; .reg .f32 flo, fhi; mov.b32 one, 0x3c003c00; mov.b32 m1032, 0xe408e408; mov.b32 sixteenth, 0x2c002c00; mov.b32 m72, 0xd480d480; lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 t, t, one, m1032; mul.rn.f16x2 acc, t, $5; lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, sixteenth, m72; fma.rn.f16x2 acc, t, $6, acc; shr.b32 w, $1, 8; lop3.b32 t, w, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 t, t, one, m1032; fma.rn.f16x2 acc, t, $7, acc; lop3.b32 t, w, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, sixteenth, m72; fma.rn.f16x2 acc, t, $8, acc; lop3.b32 t, $2, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 t, t, one, m1032; fma.rn.f16x2 acc, t, $9, acc; lop3.b32 t, $2, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, sixteenth, m72; fma.rn.f16x2 acc, t, $10, acc; shr.b32 w, $2, 8; lop3.b32 t, w, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 t, t, one, m1032; fma.rn.f16x2 acc, t, $11, acc; lop3.b32 t, w, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, sixteenth, m72; fma.rn.f16x2 acc, t, $12, acc; lop3.b32 t, $3, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 t, t, one, m1032; fma.rn.f16x2 acc, t, $13, acc; lop3.b32 t, $3, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, sixteenth, m72; fma.rn.f16x2 acc, t, $14, acc; shr.b32 w, $3, 8; lop3.b32 t, w, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 t, t, one, m1032; fma.rn.f16x2 acc, t, $15, acc; lop3.b32 t, w, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, sixteenth, m72; fma.rn.f16x2 acc, t, $16, acc; lop3.b32 t, $4, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 t, t, one, m1032; fma.rn.f16x2 acc, t, $17, acc; lop3.b32 t, $4, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, sixteenth, m72; fma.rn.f16x2 acc, t, $18, acc; shr.b32 w, $4, 8; lop3.b32 t, w, 0x000F000F, 0x64006400, 0xEA; fma.rn.f16x2 t, t, one, m1032; fma.rn.f16x2 acc, t, $19, acc; lop3.b32 t, w, 0x00F000F0, 0x64006400, 0xEA; fma.rn.f16x2 t, t, sixteenth, m72; fma.rn.f16x2 acc, t, $20, acc; mov.b32 {lo, hi}, acc; cvt.f32.f16 flo, lo; cvt.f32.f16 fhi, hi; add.f32 flo, flo, fhi; mov.b32 $0, flo; }", "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r", [w0, w1, w2, w3, x0_0, x0_1, x0_2, x0_3, x1_0, x1_1, x1_2, x1_3, x2_0, x2_1, x2_2, x2_3, x3_0, x3_1, x3_2, x3_3], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def gemm_w4a16_kernel(x_ptr, w_packed_ptr, scales_ptr, y_ptr, x_s0, w_packed_s0, scales_s0, y_s0, M, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
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
    part0 = tl.zeros([BLOCK_K // 32, BLOCK_N], dtype=tl.float32)
    rmask_p_r0 = r0 < M
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=1):
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
        w_lo, w_hi = tl.split(tl.reshape(tl.permute(tl.reshape(words_w_packed, [BLOCK_K // 32, 4, BLOCK_N]), (0, 2, 1)), [BLOCK_K // 32, BLOCK_N, 2, 2]))
        w0, w2 = tl.split(w_lo)
        w1, w3 = tl.split(w_hi)
        kq = k0 + 4 * tl.arange(0, BLOCK_K // 32)[:, None] // 16 * 128 + 4 * tl.arange(0, BLOCK_K // 32)[:, None] % 16
        t0 = (kq // G)
        t1 = tl.load(scales_ptr + c.to(tl.int64) * scales_s0 + t0).to(tl.float32)
        rmask0 = r0 < M
        t2 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka0, mask=rmask0, other=0).to(tl.float32)
        t3 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka1, mask=rmask0, other=0).to(tl.float32)
        t4 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka2, mask=rmask0, other=0).to(tl.float32)
        t5 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka3, mask=rmask0, other=0).to(tl.float32)
        t6 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka4, mask=rmask0, other=0).to(tl.float32)
        t7 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka5, mask=rmask0, other=0).to(tl.float32)
        t8 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka6, mask=rmask0, other=0).to(tl.float32)
        t9 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka7, mask=rmask0, other=0).to(tl.float32)
        xq0 = _x_pair((t2.to(tl.float32) * 0.00390625), (t6.to(tl.float32) * 0.00390625))
        xq1 = _x_pair((t3.to(tl.float32) * 0.00390625), (t7.to(tl.float32) * 0.00390625))
        xq2 = _x_pair((t4.to(tl.float32) * 0.00390625), (t8.to(tl.float32) * 0.00390625))
        xq3 = _x_pair((t5.to(tl.float32) * 0.00390625), (t9.to(tl.float32) * 0.00390625))
        xp0__lo, xp0__hi = tl.split(tl.reshape(tl.permute(tl.reshape(xq0, [BLOCK_K // 32, 4, 1]), (0, 2, 1)), [BLOCK_K // 32, 1, 2, 2]))
        xp0_0, xp0_2 = tl.split(xp0__lo)
        xp0_1, xp0_3 = tl.split(xp0__hi)
        xp1__lo, xp1__hi = tl.split(tl.reshape(tl.permute(tl.reshape(xq1, [BLOCK_K // 32, 4, 1]), (0, 2, 1)), [BLOCK_K // 32, 1, 2, 2]))
        xp1_0, xp1_2 = tl.split(xp1__lo)
        xp1_1, xp1_3 = tl.split(xp1__hi)
        xp2__lo, xp2__hi = tl.split(tl.reshape(tl.permute(tl.reshape(xq2, [BLOCK_K // 32, 4, 1]), (0, 2, 1)), [BLOCK_K // 32, 1, 2, 2]))
        xp2_0, xp2_2 = tl.split(xp2__lo)
        xp2_1, xp2_3 = tl.split(xp2__hi)
        xp3__lo, xp3__hi = tl.split(tl.reshape(tl.permute(tl.reshape(xq3, [BLOCK_K // 32, 4, 1]), (0, 2, 1)), [BLOCK_K // 32, 1, 2, 2]))
        xp3_0, xp3_2 = tl.split(xp3__lo)
        xp3_1, xp3_3 = tl.split(xp3__hi)
        d0 = _int4_quad_dot(w0, w1, w2, w3, tl.broadcast_to(xp0_0, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp1_0, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp2_0, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp3_0, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp0_1, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp1_1, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp2_1, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp3_1, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp0_2, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp1_2, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp2_2, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp3_2, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp0_3, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp1_3, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp2_3, [BLOCK_K // 32, BLOCK_N]), tl.broadcast_to(xp3_3, [BLOCK_K // 32, BLOCK_N])) * 256.0
        part0 += d0 * t1
    row_ids = tl.arange(0, BLOCK_M)[:, None]
    acc_acc = tl.where(row_ids == 0, (tl.sum(part0, axis=0))[None, :], acc_acc)
    tl.store(y_ptr + r.to(tl.int64) * y_s0 + c, acc_acc.to(tl.bfloat16), mask=rmask)
