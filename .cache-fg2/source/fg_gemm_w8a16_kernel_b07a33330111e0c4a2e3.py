# flashgen: gemm_w8a16 (contraction) - y = epilogue(x @ (w_int8 * w_scale[n]).T): int8 weights, per-channel fp32 scales, fp16/bf16 activations
# dims: {"K": 4096, "N": 6144} (run time: M); attrs: {"act": "none", "dtype": "bf16", "out": "none", "with_bias": "no", "with_residual": "no"}
# schedule: {"block_k": 512, "block_m": 1, "block_n": 16, "dequant_chunks": 1, "dequant_first": 0, "early_load": 1, "group_m": 1, "num_stages": 3, "num_warps": 4, "operand_scale": 0, "persistent": 0, "ptx_unpack": 0, "split_k": 1, "tma": 0}
import triton
import triton.language as tl


@triton.jit
def gemm_w8a16_kernel(x_ptr, w_ptr, w_scale_ptr, y_ptr, x_s0, w_s0, y_s0, M, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr):
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
    t0 = tl.load(w_ptr + c.to(tl.int64) * w_s0 + kb)
    t1 = t0.to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rmask_p_r0 = r0 < M
    rmask0 = r0 < M
    t2 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + kb, mask=rmask0, other=0).to(tl.float32)
    part0 += t2.to(tl.float32) * t1
    for k0 in tl.range(k_lo + BLOCK_K, k_hi, BLOCK_K, num_stages=3):
        kb = k0 + tl.arange(0, BLOCK_K)[:, None]
        t3 = tl.load(w_ptr + c.to(tl.int64) * w_s0 + kb)
        t4 = t3.to(tl.float32)
        rmask0 = r0 < M
        t5 = tl.load(x_ptr + r0.to(tl.int64) * x_s0 + kb, mask=rmask0, other=0).to(tl.float32)
        part0 += t5.to(tl.float32) * t4
    row_ids = tl.arange(0, BLOCK_M)[:, None]
    acc_acc = tl.where(row_ids == 0, (tl.sum(part0, axis=0))[None, :], acc_acc)
    t6 = tl.load(w_scale_ptr + c).to(tl.float32)
    t7 = (acc_acc * t6)
    tl.store(y_ptr + r.to(tl.int64) * y_s0 + c, t7.to(tl.bfloat16), mask=rmask)
