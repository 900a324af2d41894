# flashgen: rmsnorm_gemm (contraction) - y = epilogue(x @ w.T) (fp16/bf16, fp32 accumulation), x RMS-normalized on the way in (rmsnorm(x) * norm_w)
# dims: {"K": 4096, "N": 6144} (run time: M); attrs: {"act": "none", "dtype": "bf16", "out": "none", "with_bias": "no", "with_residual": "no"}
# schedule: {"block_k": 128, "block_m": 64, "block_n": 128, "dequant_chunks": 1, "dequant_first": 0, "early_load": 0, "group_m": 8, "num_stages": 3, "num_warps": 4, "operand_scale": 0, "persistent": 0, "ptx_unpack": 0, "split_k": 1, "tma": 0}
import triton
import triton.language as tl


@triton.jit
def rmsnorm_gemm_kernel(x_ptr, norm_w_ptr, w_ptr, y_ptr, x_s0, w_s0, y_s0, M, eps, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
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
    rmask_p = r < M
    ss = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    for kp0 in range(0, K, 64):
        kp = kp0 + tl.arange(0, 64)[None, :]
        kpmask = kp < K
        t0 = tl.load(x_ptr + r.to(tl.int64) * x_s0 + kp, mask=kpmask & rmask_p, other=0).to(tl.float32)
        t1 = (t0 * t0)
        v_p = tl.where(kpmask, t1, 0.0)
        ss += tl.sum(v_p, axis=1)[:, None]
    t2 = (ss / K)
    t3 = (t2 + eps)
    t4 = tl.rsqrt(t3)
    inv = t4
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ka = k0 + tl.arange(0, BLOCK_K)[None, :]
        kb = k0 + tl.arange(0, BLOCK_K)[:, None]
        t5 = tl.load(x_ptr + r.to(tl.int64) * x_s0 + ka, mask=rmask, other=0).to(tl.float32)
        t6 = (t5 * inv)
        t7 = tl.load(norm_w_ptr + ka).to(tl.float32)
        t8 = (t6 * t7)
        t9 = t8.to(tl.bfloat16)
        t10 = tl.load(w_ptr + c.to(tl.int64) * w_s0 + kb)
        acc_acc = tl.dot(t9, t10, acc_acc, out_dtype=tl.float32)
    tl.store(y_ptr + r.to(tl.int64) * y_s0 + c, acc_acc.to(tl.bfloat16), mask=rmask)
