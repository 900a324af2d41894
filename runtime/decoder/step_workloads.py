"""The kernels one decode step launches on a GPU, in launch order, for a model config, a quant mode and a
batch: what `flashgen tune --model` tunes, and whose estimates add up to the step's time.

The decoder itself cannot run end to end without a GPU's device tensors (its attention and experts take
the generated path only on CUDA), so the step is traced layer by layer from the config, as
`Decoder.forward` runs it on a GPU: each linear through the decoder's own `linear.apply` and experts
through `moe_experts.run_experts`, with their weights prepared by the mode's own class on meta tensors
(nothing is quantized, nothing allocated), and the norms, RoPE, the decode attention and the router as
`Decoder.forward` calls them; `calls.Recorder` stands for `torch.ops.flashgen`, so every op is bound to
its Workload as dispatch binds it. A mixed linear computes each call in the mode `plan` (the decoder's
`ModePlan` over the same database) picks. Decode only: one new token per sequence, each sequence's
cache holding the model's whole context (the table width the decoder sizes its steps by). The
embedding gather, the router's and lm_head's products and the sampling are torch code, not kernels of
flashgen: they are not traced. Where the experts have no generated form (fp8, a top-k the moe ops do
not take) the decoder runs them as torch-gathered linears in the mode, of a row count only the router
decides: they are traced at the mean, the batch's pairs over the experts a random router touches.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from flashgen.oplib.moe import MOE_GEMM_GATE_UP, MOE_ROUTE
from flashgen.runtime.checkpoints.model_config import ModelConfig
from flashgen.runtime.checkpoints.rope_scaling import rope_table
from flashgen.runtime.decoder.calls import Recorder
from flashgen.runtime.decoder.linear import PLAIN, CallForm, apply
from flashgen.runtime.decoder.model import IDS_ROUTING_MAX_TOKENS, context_bucket
from flashgen.runtime.decoder.moe_experts import run_experts
from flashgen.runtime.decoder.quant_modes import QuantLinear, quant_mode
from flashgen.schedules.moe_space import touched_experts
from flashgen.workload import Workload

BLOCK_SIZE = 16  # the paged cache's tokens per block (runtime/decoder/kv_cache.py's default)
Launch = tuple[Workload, Workload | None]  # a kernel and the one launched just before it in the step, if any


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


class _Weights:
    """A model's linears in one mode as meta tensors, one per shape (prepared as `Decoder._prepare`
    prepares them, settled by the mixed mode's plan)."""

    def __init__(self, mode: type[QuantLinear], plan: Callable | None, dtype: torch.dtype):
        self.mode, self.plan, self.dtype = mode, plan, dtype
        self.linears: dict[tuple[int, int], QuantLinear] = {}

    def __call__(self, n: int, k: int, form: CallForm = PLAIN) -> QuantLinear:
        if (n, k) not in self.linears:
            q = self.mode.prepare(_meta(n, k, dtype=self.dtype))
            self.linears[n, k] = q.settle(self.plan, form) if self.plan is not None else q
        return self.linears[n, k]

    def stacked(self, experts: int, n: int, k: int) -> dict[str, torch.Tensor]:
        """An expert linear's moe-op tensors, stacked for `experts` experts (`stack_experts`' layout)."""
        return {name: t.expand(experts, *t.shape) for name, t in self.mode.expert(_meta(n, k, dtype=self.dtype)).items()}


def decode_step(c: ModelConfig, mode: str, batch: int, plan: Callable | None = None,
                dtype: torch.dtype = torch.bfloat16, context: int | None = None) -> list[Launch]:
    """Each kernel a decode step of `batch` sequences launches in `mode`, with the kernel before it
    (module docstring); `plan` is the mixed mode's chooser (runtime/decoder/mixed.py `ModePlan`);
    `context`: the step's longest context (default: the model's whole window), which sets the
    attention's context bucket (`context_bucket`)."""
    cls = quant_mode(mode)
    weights, rec = _Weights(cls, plan, dtype), Recorder()
    h, nq, nk, ff = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    width = -(-c.max_position_embeddings // BLOCK_SIZE)  # `Decoder.table_width`: a whole context
    blocks = batch * width
    kc = _meta(blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, dtype=dtype)
    cos_sin = _meta(c.max_position_embeddings, rope_table(c, 1).shape[1], dtype=torch.float32)
    table, ctx = _meta(batch, width, dtype=torch.int32), _meta(batch, dtype=torch.int32)
    positions = slots = _meta(batch, dtype=torch.int64)

    def linear(x: torch.Tensor, n: int, bias: bool, **kw) -> torch.Tensor:
        form = CallForm(norm="norm" in kw, gated=kw.get("gated", False), residual="residual" in kw, bias=bias)
        return apply(x, weights(n, x.shape[1] // (2 if form.gated else 1), form), _meta(n, dtype=dtype) if bias else None,
                     set(), plan, eps=c.rms_norm_eps, ops=rec, **kw)

    x = _meta(batch, h, dtype=dtype)
    for i in range(c.num_layers):
        linear(x, nq + 2 * nk, c.qkv_bias, norm=_meta(h, dtype=dtype))
        q, k, v = _meta(batch, c.num_heads, c.head_dim, dtype=dtype), _meta(batch, c.num_kv_heads, c.head_dim, dtype=dtype), \
            _meta(batch, c.num_kv_heads, c.head_dim, dtype=dtype)
        if c.qk_norm:
            rec.rmsnorm(q.reshape(-1, c.head_dim), _meta(c.head_dim, dtype=dtype), c.rms_norm_eps)
            rec.rmsnorm(k.reshape(-1, c.head_dim), _meta(c.head_dim, dtype=dtype), c.rms_norm_eps)
        views = kc.view(-1, *kc.shape[2:])
        q, k = rec.rope_cache(q, k, positions, cos_sin, v, slots, views, views)
        window = c.layer_window(i)
        bound = min(width, blocks) * BLOCK_SIZE
        dims = [batch, c.num_heads, c.num_kv_heads, c.head_dim, BLOCK_SIZE, blocks, width,
                context_bucket(context, bound) if context else bound]
        a = rec.paged_decode_attention(q, kc, kc, table, ctx, None, float(window or 1024), dims=dims,
                                       **({"mod": "window"} if window else {}))
        x = linear(a.reshape(-1, nq), h, c.o_bias, residual=x)
        if c.layer_moe(i):
            _moe(c, rec, weights, cls, rec.rmsnorm(x, _meta(h, dtype=dtype), c.rms_norm_eps), linear)
        else:
            up = linear(x, 2 * ff, c.mlp_bias, norm=_meta(h, dtype=dtype))
            x = linear(up, h, c.mlp_bias, gated=True, residual=x)
    rec.rmsnorm(x, _meta(h, dtype=dtype), c.rms_norm_eps)
    return [(wl, rec.calls[j - 1] if j else None) for j, wl in enumerate(rec.calls)]


def _moe(c: ModelConfig, rec: Recorder, weights: _Weights, cls: type[QuantLinear], x: torch.Tensor,
         linear: Callable[..., torch.Tensor]) -> None:
    """The kernels of `Decoder.moe` for the normed hidden states `x` on a GPU."""
    t, h, inter, k = x.shape[0], c.hidden_size, c.moe_intermediate_size, c.experts_per_tok
    if str(k) in MOE_ROUTE.attrs["topk"]:
        rec.moe_route(_meta(t, c.num_experts, dtype=torch.float32), topk=str(k), renorm="yes" if c.norm_topk_prob else "no")
    form = cls.stacked_format(h, inter) if str(k) in MOE_GEMM_GATE_UP.attrs["topk"] else None
    if form is not None:  # `Decoder._generated_experts`
        ids = _meta(t, k, dtype=torch.int32)
        routing = ({"routing": "ids", "topk_ids": ids} if t <= IDS_ROUTING_MAX_TOKENS else
                   {"sorted_pairs": _meta(t * k, dtype=torch.int32), "expert_offsets": _meta(c.num_experts + 1, dtype=torch.int32)})
        stacked = (weights.stacked(c.num_experts, 2 * inter, h), weights.stacked(c.num_experts, h, inter))
        run_experts(rec, x, stacked, routing, _meta(t * k, dtype=torch.float32), {"topk": str(k), "weights": form},
                    cls.activations)
    else:  # `Decoder._torch_experts`: each touched expert's tokens through its linears, at the mean count
        touched = max(1, round(touched_experts(t, c.num_experts, k)))
        rows = math.ceil(t * k / touched)
        for _ in range(touched):
            linear(linear(x[:rows], 2 * inter, False), h, False, gated=True)
    if c.shared_expert_intermediate_size:
        linear(linear(x, 2 * c.shared_expert_intermediate_size, False), h, False, gated=True)

