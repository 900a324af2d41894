# flashgen: rmsnorm_gemm_w4a16 (contraction) - y = epilogue(x @ dequant(w_int4).T): 4-bit weights packed 8 per int32 (interleaved, flashgen/quant.py), group or per-channel scales, symmetric or with zero points, x RMS-normalized on the way in (rmsnorm(x) * norm_w)
# dims: {"G": 128, "K": 4096, "N": 6144} (run time: M); attrs: {"act": "none", "dtype": "bf16", "group": "group", "out": "none", "pack": "k128", "with_bias": "no", "with_residual": "no", "zp": "sym"}
# schedule: {"block_k": 128, "block_m": 64, "block_n": 64, "dequant_chunks": 1, "dequant_first": 0, "early_load": 0, "group_m": 8, "num_stages": 4, "num_warps": 4, "operand_scale": 0, "persistent": 0, "ptx_unpack": 1, "split_k": 2, "tma": 0}
import triton
import triton.language as tl


@triton.jit
def _int4_code0_bf16(words):
    return tl.inline_asm_elementwise("{ .reg .b32 t, one, minus; prmt.b32 t, $1, $2, 0x5410; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3f803f80; mov.b32 minus, 0xc308c308; fma.rn.bf16x2 $0, t, one, minus; }", "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _int4_code1_bf16(words):
    return tl.inline_asm_elementwise("{ .reg .b32 t, one, minus; prmt.b32 t, $1, $2, 0x5410; shr.b32 t, t, 4; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3f803f80; mov.b32 minus, 0xc308c308; fma.rn.bf16x2 $0, t, one, minus; }", "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _int4_code2_bf16(words):
    return tl.inline_asm_elementwise("{ .reg .b32 t, one, minus; prmt.b32 t, $1, $2, 0x5410; shr.b32 t, t, 8; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3f803f80; mov.b32 minus, 0xc308c308; fma.rn.bf16x2 $0, t, one, minus; }", "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _int4_code3_bf16(words):
    return tl.inline_asm_elementwise("{ .reg .b32 t, one, minus; prmt.b32 t, $1, $2, 0x5410; shr.b32 t, t, 12; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3f803f80; mov.b32 minus, 0xc308c308; fma.rn.bf16x2 $0, t, one, minus; }", "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _int4_code4_bf16(words):
    return tl.inline_asm_elementwise("{ .reg .b32 t, one, minus; prmt.b32 t, $1, $2, 0x7632; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3f803f80; mov.b32 minus, 0xc308c308; fma.rn.bf16x2 $0, t, one, minus; }", "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _int4_code5_bf16(words):
    return tl.inline_asm_elementwise("{ .reg .b32 t, one, minus; prmt.b32 t, $1, $2, 0x7632; shr.b32 t, t, 4; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3f803f80; mov.b32 minus, 0xc308c308; fma.rn.bf16x2 $0, t, one, minus; }", "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _int4_code6_bf16(words):
    return tl.inline_asm_elementwise("{ .reg .b32 t, one, minus; prmt.b32 t, $1, $2, 0x7632; shr.b32 t, t, 8; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3f803f80; mov.b32 minus, 0xc308c308; fma.rn.bf16x2 $0, t, one, minus; }", "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _int4_code7_bf16(words):
    return tl.inline_asm_elementwise("{ .reg .b32 t, one, minus; prmt.b32 t, $1, $2, 0x7632; shr.b32 t, t, 12; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; mov.b32 one, 0x3f803f80; mov.b32 minus, 0xc308c308; fma.rn.bf16x2 $0, t, one, minus; }", "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def rmsnorm_gemm_w4a16_kernel(x_ptr, norm_w_ptr, w_packed_ptr, scales_ptr, y_ptr, part_ptr, done_ptr, x_s0, w_packed_s0, scales_s0, y_s0, M, eps, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
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
    split = tl.program_id(2)
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = split * k_span
    k_hi = tl.minimum(K, k_lo + k_span)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    r_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    rmask_p = r_p < M
    ss = tl.zeros([1, BLOCK_M], dtype=tl.float32)
    for kp0 in range(0, K, 64):
        kp = kp0 + tl.arange(0, 64)[:, None]
        kpmask = kp < K
        t0 = tl.load(x_ptr + r_p.to(tl.int64) * x_s0 + kp, mask=kpmask & rmask_p, other=0).to(tl.float32)
        t1 = (t0 * t0)
        v_p = tl.where(kpmask, t1, 0.0)
        ss += tl.sum(v_p, axis=0)[None, :]
    t2 = (ss / K)
    t3 = (t2 + eps)
    t4 = tl.rsqrt(t3)
    inv = t4
    r_t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    rmask_t = r_t < M
    c_t = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    acc_acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kw0 = k0 // 8 + 0 + tl.arange(0, 16)[None, :]
        words0 = tl.load(w_packed_ptr + c_t.to(tl.int64) * w_packed_s0 + kw0)
        kx0 = k0 + 0 + tl.arange(0, 128)[:, None]
        t5 = tl.load(x_ptr + r_t.to(tl.int64) * x_s0 + kx0, mask=rmask_t, other=0).to(tl.float32)
        t6 = (t5 * inv)
        t7 = tl.load(norm_w_ptr + kx0).to(tl.float32)
        t8 = (t6 * t7)
        t9 = t8.to(tl.bfloat16)
        c0 = _int4_code0_bf16(words0)
        c1 = _int4_code1_bf16(words0)
        c2 = _int4_code2_bf16(words0)
        c3 = _int4_code3_bf16(words0)
        c4 = _int4_code4_bf16(words0)
        c5 = _int4_code5_bf16(words0)
        c6 = _int4_code6_bf16(words0)
        c7 = _int4_code7_bf16(words0)
        w0 = tl.reshape(tl.permute(tl.join(tl.join(tl.join(c0, c1), tl.join(c2, c3)), tl.join(tl.join(c4, c5), tl.join(c6, c7))), (0, 4, 3, 2, 1)), [BLOCK_N, 128])
        seg = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        seg = tl.dot(w0, t9, seg)
        kseg0 = k0 + 0
        t10 = (kseg0 // G)
        t11 = tl.load(scales_ptr + c_t.to(tl.int64) * scales_s0 + t10).to(tl.float32)
        acc_acc_t += seg * t11
    acc_acc = tl.trans(acc_acc_t)
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(part_ptr + (pid * SPLIT_K + split).to(tl.int64) * (BLOCK_M * BLOCK_N) + offs, acc_acc)
    tl.debug_barrier()
    finished = tl.atomic_add(done_ptr + pid, 1)  # acq_rel at gpu scope
    if finished == SPLIT_K - 1:
        tl.debug_barrier()
        acc_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i in tl.static_range(SPLIT_K):
            acc_acc += tl.load(part_ptr + (pid * SPLIT_K + i).to(tl.int64) * (BLOCK_M * BLOCK_N) + offs, volatile=True)
        tl.atomic_xchg(done_ptr + pid, 0)
        tl.store(y_ptr + r.to(tl.int64) * y_s0 + c, acc_acc.to(tl.bfloat16), mask=rmask)
