"""The README's Python quick start, runnable as written on a machine without a GPU.

It compiles an RMSNorm ahead of time for an H200 (Triton to PTX and a cubin; nothing runs), then builds
the same workload for the CPU (a TVM kernel) and checks what it computes against torch.

    python examples/quickstart.py
"""
import torch

import flashgen

wl = flashgen.workload("rmsnorm", M=64, N=1000, dtype="fp32")
print(wl.key)

k = flashgen.compile(wl, target="h200")          # ahead of time: no GPU needed
print(k.binary_kind, len(k.binary), "bytes;", next(l for l in k.asm["ptx"].splitlines() if l.startswith(".target")))

cpu = flashgen.compile(wl, target="cpu")         # a TVM kernel, callable on CPU tensors
x, w = torch.randn(64, 1000), torch.randn(1000)
y = cpu(x, w, eps=1e-6)
want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
print("max error vs torch:", (y - want).abs().max().item())
assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)
