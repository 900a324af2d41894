# flashgen: gemm_w4a16 (contraction) - y = epilogue(x @ dequant(w_int4).T): 4-bit weights packed 8 per int32 (interleaved, flashgen/quant.py), group or per-channel scales, symmetric or with zero points
# dims: {"G": 128, "K": 4096, "N": 4096} (run time: M); attrs: {"act": "none", "dtype": "bf16", "group": "group", "out": "none", "pack": "k128", "with_bias": "no", "with_residual": "no", "zp": "sym"}
# schedule: {"block_k": 128, "block_m": 16, "block_n": 64, "dequant_chunks": 1, "dequant_first": 0, "early_load": 0, "group_m": 8, "num_stages": 4, "num_warps": 4, "operand_scale": 0, "persistent": 0, "ptx_unpack": 0, "split_k": 4, "tma": 0}
import triton
import triton.language as tl


@triton.jit
def gemm_w4a16_kernel(x_ptr, w_packed_ptr, scales_ptr, y_ptr, part_ptr, done_ptr, x_s0, w_packed_s0, scales_s0, y_s0, M, N: tl.constexpr, K: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
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
    r_t = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    rmask_t = r_t < M
    c_t = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    acc_acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kw0 = k0 // 8 + 0 + tl.arange(0, 16)[None, :]
        words0 = tl.load(w_packed_ptr + c_t.to(tl.int64) * w_packed_s0 + kw0)
        kx0 = k0 + 0 + tl.arange(0, 128)[:, None]
        t0 = tl.load(x_ptr + r_t.to(tl.int64) * x_s0 + kx0, mask=rmask_t, other=0)
        c0 = ((words0 & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c1 = (((words0 >> 4) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c2 = (((words0 >> 8) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c3 = (((words0 >> 12) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c4 = (((words0 >> 16) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c5 = (((words0 >> 20) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c6 = (((words0 >> 24) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        c7 = (((words0 >> 28) & 15) | 17152).to(tl.int16).to(tl.bfloat16, bitcast=True) - 136.0
        w0 = tl.reshape(tl.permute(tl.join(tl.join(tl.join(c0, c1), tl.join(c2, c3)), tl.join(tl.join(c4, c5), tl.join(c6, c7))), (0, 4, 3, 2, 1)), [BLOCK_N, 128])
        seg = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        seg = tl.dot(w0, t0, seg)
        kseg0 = k0 + 0
        t1 = (kseg0 // G)
        t2 = tl.load(scales_ptr + c_t.to(tl.int64) * scales_s0 + t1).to(tl.float32)
        acc_acc_t += seg * t2
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
