# flashgen: dequant_w4a16 (pointwise) - the weight of gemm_w4a16, dequantized to the activation dtype
# dims: {"G": 128, "K": 4096} (run time: N); attrs: {"dtype": "bf16", "group": "group", "pack": "k128", "zp": "sym"}
# schedule: {"block_c": 2048, "block_r": 1, "num_warps": 1}
import triton
import triton.language as tl


@triton.jit
def dequant_w4a16_kernel(w_packed_ptr, scales_ptr, weight_ptr, w_packed_s0, scales_s0, weight_s0, N, K: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    t0 = (c // 128)
    t1 = (t0 * 16)
    t2 = (c % 16)
    t3 = (t1 + t2)
    t4 = tl.load(w_packed_ptr + r.to(tl.int64) * w_packed_s0 + t3)
    t5 = (c % 128)
    t6 = (t5 // 16)
    t7 = (t6 * 4)
    t8 = (t4 >> t7)
    t9 = (t8 & 15)
    t10 = (t9 - 8)
    t11 = (c // G)
    t12 = tl.load(scales_ptr + r.to(tl.int64) * scales_s0 + t11).to(tl.float32)
    t13 = (t10 * t12)
    tl.store(weight_ptr + r.to(tl.int64) * weight_s0 + c, t13.to(tl.bfloat16))
