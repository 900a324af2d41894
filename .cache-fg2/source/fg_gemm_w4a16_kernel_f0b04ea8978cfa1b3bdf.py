# flashgen: gemm_w4a16 (contraction) - y = epilogue(x @ dequant(w_int4).T): 4-bit weights packed 8 per int32 (interleaved, flashgen/quant.py), group or per-channel scales, symmetric or with zero points
# dims: {"G": 128, "K": 4096, "N": 6144} (run time: M); attrs: {"act": "none", "dtype": "bf16", "group": "group", "out": "none", "pack": "k128", "with_bias": "no", "with_residual": "no", "zp": "sym"}
# schedule: {"block_k": 1024, "block_m": 1, "block_n": 16, "dequant_chunks": 1, "dequant_first": 0, "early_load": 0, "group_m": 1, "num_stages": 3, "num_warps": 4, "operand_scale": 0, "persistent": 0, "ptx_unpack": 0, "split_k": 1, "tma": 0}
import triton
import triton.language as tl


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
    part0 = tl.zeros([BLOCK_K // 8, BLOCK_N], dtype=tl.float32)
    magic = 0x4B000000 | (M >> 31)
    rmask_p_r0 = r0 < M
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=3):
        kw_w_packed = k0 // 8 + tl.arange(0, BLOCK_K // 8)[:, None]
        words_w_packed = tl.load(w_packed_ptr + c.to(tl.int64) * w_packed_s0 + kw_w_packed)
        words_w_packed_hi = words_w_packed >> 12
        kw0 = k0 + tl.arange(0, BLOCK_K // 8)[:, None] // 16 * 128 + tl.arange(0, BLOCK_K // 8)[:, None] % 16
        ka0 = kw0 + 0
        t0 = (ka0 // G)
        t1 = tl.load(scales_ptr + c.to(tl.int64) * scales_s0 + t0).to(tl.float32)
        w0 = ((words_w_packed & 15) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8 * 1.0)
        ka1 = kw0 + 16
        w1 = ((words_w_packed & 240) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8 * 16.0)
        ka2 = kw0 + 32
        w2 = ((words_w_packed & 3840) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8 * 256.0)
        ka3 = kw0 + 48
        w3 = ((words_w_packed & 61440) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8 * 4096.0)
        ka4 = kw0 + 64
        w4 = ((words_w_packed & 983040) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8 * 65536.0)
        ka5 = kw0 + 80
        w5 = ((words_w_packed_hi & 3840) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8 * 256.0)
        ka6 = kw0 + 96
        w6 = ((words_w_packed_hi & 61440) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8 * 4096.0)
        ka7 = kw0 + 112
        w7 = ((words_w_packed_hi & 983040) | magic).to(tl.float32, bitcast=True) - (8388608.0 + 8 * 65536.0)
        rmask0 = r0 < M
        t2 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka0, mask=rmask0, other=0).to(tl.float32)
        t3 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka1, mask=rmask0, other=0).to(tl.float32)
        t4 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka2, mask=rmask0, other=0).to(tl.float32)
        t5 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka3, mask=rmask0, other=0).to(tl.float32)
        t6 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka4, mask=rmask0, other=0).to(tl.float32)
        t7 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka5, mask=rmask0, other=0).to(tl.float32)
        t8 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka6, mask=rmask0, other=0).to(tl.float32)
        t9 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + ka7, mask=rmask0, other=0).to(tl.float32)
        part0 += (t2.to(tl.float32) * w0 + t3.to(tl.float32) * 0.0625 * w1 + t4.to(tl.float32) * 0.00390625 * w2 + t5.to(tl.float32) * 0.000244140625 * w3 + t6.to(tl.float32) * 1.52587890625e-05 * w4 + t7.to(tl.float32) * 0.00390625 * w5 + t8.to(tl.float32) * 0.000244140625 * w6 + t9.to(tl.float32) * 1.52587890625e-05 * w7) * t1
    row_ids = tl.arange(0, BLOCK_M)[:, None]
    acc_acc = tl.where(row_ids == 0, (tl.sum(part0, axis=0))[None, :], acc_acc)
    tl.store(y_ptr + r.to(tl.int64) * y_s0 + c, acc_acc.to(tl.bfloat16), mask=rmask)
