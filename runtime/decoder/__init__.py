"""The decoder: a Llama-family model over a paged KV cache on the generated kernels, its batched engine
and sampling, its linears in each quant mode, MoE experts, decode steps replayed from CUDA graphs,
tensor-parallel ranks, and `bench-model`."""
