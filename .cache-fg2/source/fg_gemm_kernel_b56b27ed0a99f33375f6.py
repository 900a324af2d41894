# flashgen: gemm (contraction) - y = epilogue(x @ w.T) (fp16/bf16, fp32 accumulation)
# dims: {"K": 4096, "N": 6144} (run time: M); attrs: {"act": "none", "dtype": "bf16", "out": "none", "with_bias": "no", "with_residual": "no"}
# schedule: {"block_k": 64, "block_m": 128, "block_n": 256, "dequant_first": 0, "early_load": 0, "group_m": 8, "num_stages": 4, "num_warps": 8, "operand_scale": 0, "persistent": 0, "ptx_unpack": 0, "split_k": 1, "tma": 1}
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
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[x_s0, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[w_s0, 1], block_shape=[BLOCK_N, BLOCK_K])
    for k0 in range(k_lo, k_hi, BLOCK_K):
        acc_acc = tl.dot(x_desc.load([pid_m * BLOCK_M, k0]), w_desc.load([pid_n * BLOCK_N, k0]).T, acc_acc, out_dtype=tl.float32)
    tl.store(y_ptr + r.to(tl.int64) * y_s0 + c, acc_acc.to(tl.bfloat16), mask=rmask)
