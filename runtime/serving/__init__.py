"""Serving generated kernels to torch: which kernel a call gets (dispatch by shape, the nearest tuned
bucket), the `torch.ops.flashgen` ops that launch them, and CUDA graph capture."""
