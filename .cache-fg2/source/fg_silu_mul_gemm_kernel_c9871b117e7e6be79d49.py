# flashgen: silu_mul_gemm (contraction) - y = epilogue(x @ w.T) (fp16/bf16, fp32 accumulation), x = silu(g) * u of xg = [g | u] (M x 2K)
# dims: {"K": 14336, "N": 4096} (run time: M); attrs: {"act": "none", "dtype": "bf16", "out": "none", "with_bias": "no", "with_residual": "yes"}
# schedule: {"block_k": 512, "block_m": 1, "block_n": 16, "dequant_chunks": 1, "dequant_first": 0, "early_load": 1, "group_m": 1, "num_stages": 3, "num_warps": 4, "operand_scale": 0, "persistent": 0, "ptx_unpack": 0, "split_k": 1, "tma": 0}
import triton
import triton.language as tl


@triton.jit
def silu_mul_gemm_kernel(xg_ptr, w_ptr, residual_ptr, y_ptr, xg_s0, w_s0, residual_s0, y_s0, M, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
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
    r0 = pid_m * BLOCK_M + 0
    part0 = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    k0 = k_lo
    kb = k0 + tl.arange(0, BLOCK_K)[:, None]
    t0 = tl.load(w_ptr + c.to(tl.int64) * w_s0 + kb).to(tl.float32)
    t1 = t0.to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rmask_p_r0 = r0 < M
    rmask0 = r0 < M
    t2 = tl.load(xg_ptr + r0.to(tl.int64) * xg_s0 + kb, mask=rmask0, other=0).to(tl.float32)
    t3 = tl.sigmoid(t2)
    t4 = (t2 * t3)
    t5 = (kb + K)
    t6 = tl.load(xg_ptr + r0.to(tl.int64) * xg_s0 + t5, mask=rmask0, other=0).to(tl.float32)
    t7 = (t4 * t6)
    part0 += t7.to(tl.float32) * t1
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=3):
        kb = k0 + tl.arange(0, BLOCK_K)[:, None]
        t8 = tl.load(w_ptr + c.to(tl.int64) * w_s0 + kb).to(tl.float32)
        t9 = t8.to(tl.float32)
        rmask0 = r0 < M
        t10 = tl.load(xg_ptr + r0.to(tl.int64) * xg_s0 + kb, mask=rmask0, other=0).to(tl.float32)
        t11 = tl.sigmoid(t10)
        t12 = (t10 * t11)
        t13 = (kb + K)
        t14 = tl.load(xg_ptr + r0.to(tl.int64) * xg_s0 + t13, mask=rmask0, other=0).to(tl.float32)
        t15 = (t12 * t14)
        part0 += t15.to(tl.float32) * t9
    row_ids = tl.arange(0, BLOCK_M)[:, None]
    acc_acc = tl.where(row_ids == 0, (tl.sum(part0, axis=0))[None, :], acc_acc)
    t16 = tl.load(residual_ptr + r.to(tl.int64) * residual_s0 + c, mask=rmask, other=0).to(tl.float32)
    t17 = (acc_acc + t16)
    tl.store(y_ptr + r.to(tl.int64) * y_s0 + c, t17.to(tl.bfloat16), mask=rmask)
