# flashgen: gemm (contraction) - y = epilogue(x @ w.T) (fp16/bf16, fp32 accumulation)
# dims: {"K": 4096, "N": 6144} (run time: M); attrs: {"act": "none", "dtype": "bf16", "out": "none", "with_bias": "no", "with_residual": "no"}
# schedule: {"block_k": 128, "block_m": 64, "block_n": 64, "group_m": 1, "num_stages": 5, "num_warps": 8}
import triton
import triton.language as tl


@triton.jit
def gemm_kernel(x_ptr, w_ptr, y_ptr, x_s0, w_s0, y_s0, M, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
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
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ka = k0 + tl.arange(0, BLOCK_K)[None, :]
        kb = k0 + tl.arange(0, BLOCK_K)[:, None]
        t0 = tl.load(x_ptr + r.to(tl.int64) * x_s0 + ka, mask=rmask, other=0)
        t1 = tl.load(w_ptr + c.to(tl.int64) * w_s0 + kb)
        acc_acc = tl.dot(t0, t1, acc_acc, out_dtype=tl.float32)
    tl.store(y_ptr + r.to(tl.int64) * y_s0 + c, acc_acc.to(tl.bfloat16), mask=rmask)
