# flashgen: gemm_w4a16 (contraction) - y = epilogue(x @ dequant(w_int4).T): 4-bit weights packed 8 per int32 (interleaved, flashgen/quant.py), group or per-channel scales, symmetric or with zero points
# dims: {"G": 64, "K": 512, "N": 256} (run time: M); attrs: {"act": "none", "dtype": "bf16", "group": "group", "out": "none", "pack": "k128", "with_bias": "no", "with_residual": "no", "zp": "sym"}
# schedule: {"block_k": 256, "block_m": 16, "block_n": 64, "group_m": 1, "num_stages": 3, "num_warps": 4}
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
    r_t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    rmask_t = r_t < M
    c_t = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    acc_acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kw0 = k0 // 8 + 0 + tl.arange(0, 16)[None, :]
        words0 = tl.load(w_packed_ptr + c_t.to(tl.int64) * w_packed_s0 + kw0)
        kx0 = k0 + 0 + tl.arange(0, 64)[:, None]
        t0 = tl.load(x_ptr + r_t.to(tl.int64) * x_s0 + kx0, mask=rmask_t, other=0)
        c0 = ((words0 & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c1 = (((words0 >> 4) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c2 = (((words0 >> 8) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c3 = (((words0 >> 12) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        w0 = tl.reshape(tl.permute(tl.join(tl.join(c0, c1), tl.join(c2, c3)), (0, 3, 2, 1)), [BLOCK_N, 64])
        seg = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        seg = tl.dot(w0, t0, seg)
        kseg0 = k0 + 0
        t1 = (kseg0 // G)
        t2 = tl.load(scales_ptr + c_t.to(tl.int64) * scales_s0 + t1).to(tl.float32)
        acc_acc_t += seg * t2
        kx4 = k0 + 64 + tl.arange(0, 64)[:, None]
        t3 = tl.load(x_ptr + r_t.to(tl.int64) * x_s0 + kx4, mask=rmask_t, other=0)
        c4 = (((words0 >> 16) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c5 = (((words0 >> 20) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c6 = (((words0 >> 24) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c7 = (((words0 >> 28) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        w4 = tl.reshape(tl.permute(tl.join(tl.join(c4, c5), tl.join(c6, c7)), (0, 3, 2, 1)), [BLOCK_N, 64])
        seg = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        seg = tl.dot(w4, t3, seg)
        kseg4 = k0 + 64
        t4 = (kseg4 // G)
        t5 = tl.load(scales_ptr + c_t.to(tl.int64) * scales_s0 + t4).to(tl.float32)
        acc_acc_t += seg * t5
        kw1 = k0 // 8 + 16 + tl.arange(0, 16)[None, :]
        words1 = tl.load(w_packed_ptr + c_t.to(tl.int64) * w_packed_s0 + kw1)
        kx8 = k0 + 128 + tl.arange(0, 64)[:, None]
        t6 = tl.load(x_ptr + r_t.to(tl.int64) * x_s0 + kx8, mask=rmask_t, other=0)
        c0 = ((words1 & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c1 = (((words1 >> 4) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c2 = (((words1 >> 8) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c3 = (((words1 >> 12) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        w8 = tl.reshape(tl.permute(tl.join(tl.join(c0, c1), tl.join(c2, c3)), (0, 3, 2, 1)), [BLOCK_N, 64])
        seg = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        seg = tl.dot(w8, t6, seg)
        kseg8 = k0 + 128
        t7 = (kseg8 // G)
        t8 = tl.load(scales_ptr + c_t.to(tl.int64) * scales_s0 + t7).to(tl.float32)
        acc_acc_t += seg * t8
        kx12 = k0 + 192 + tl.arange(0, 64)[:, None]
        t9 = tl.load(x_ptr + r_t.to(tl.int64) * x_s0 + kx12, mask=rmask_t, other=0)
        c4 = (((words1 >> 16) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c5 = (((words1 >> 20) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c6 = (((words1 >> 24) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c7 = (((words1 >> 28) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        w12 = tl.reshape(tl.permute(tl.join(tl.join(c4, c5), tl.join(c6, c7)), (0, 3, 2, 1)), [BLOCK_N, 64])
        seg = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        seg = tl.dot(w12, t9, seg)
        kseg12 = k0 + 192
        t10 = (kseg12 // G)
        t11 = tl.load(scales_ptr + c_t.to(tl.int64) * scales_s0 + t10).to(tl.float32)
        acc_acc_t += seg * t11
    acc_acc = tl.trans(acc_acc_t)
    tl.store(y_ptr + r.to(tl.int64) * y_s0 + c, acc_acc.to(tl.bfloat16), mask=rmask)
