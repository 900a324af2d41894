"""A Llama-family decoder (Llama 2/3 with scaled RoPE and optional biases, Mistral with sliding window,
Qwen2 with qkv bias and per-layer windows, Qwen3 with per-head q/k norms, Mixtral, Qwen2-MoE and
Qwen3-MoE with routed experts) over a paged KV cache, computing with flashgen's generated kernels. What
it computes is what runtime/checkpoints/model_config.py accepted: anything else was refused there.

One forward serves a batch of sequences, each bringing its new tokens (a whole prompt, a chunk, or one
decode token), packed along one token axis. Norms, SiLU·mul and RoPE (with the new tokens' keys and
values written into the cache in the same launch) run as `torch.ops.flashgen` ops on every device;
in bf16 decode steps of one row on a GPU the norms and SiLU·mul run inside the linears they feed.
Each residual add is the epilogue of the linear before it. Linears and attention run as generated
GEMM and attention kernels on a GPU and as torch code on the CPU (the `fallbacks` set names each one
used). Linears may be quantized (`quant`: bf16, w8a16, w4a16, w8a8, w4a8 or mixed; runtime/decoder/linear.py).

An MoE layer's router, unquantized so that weight rounding does not change which experts a token
gets, gives float32 logits; the generated `moe_route` kernel picks each token's top-k experts and
their weights. On a GPU, in every mode but fp8 (int4 experts where the group of 128 divides their
widths), the experts run as the generated grouped GEMMs of the moe class, their weights stacked and
quantized as the mode says, mixed's as its w4a16 linear (runtime/decoder/moe_experts.py; w8a8 and w4a8
quantize the activations per row first, as their dense linears do): `moe_gemm_gate_up` gives each
(token, expert) pair's SiLU(gate) * up, and
`moe_gemm_down` adds each pair's weighted expert output into its token's row, reading each touched
expert's weights once. A decode step's kernels find each expert's pairs in the router's ids; a longer
batch's pairs are first ordered by expert (`moe_align`, torch's sort, no host sync). Such
steps are captured in CUDA graphs like a dense model's. Otherwise (the CPU, fp8 experts) each
expert's tokens are gathered and run through its gate|up and down linears in torch (in `quant`, as the
dense layers'), scaled by their router weights and summed; that routing reads each expert's token
count on the host, so its decode steps are not captured (`capturable`). Qwen2-MoE adds its shared
expert behind a sigmoid gate.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from flashgen.errors import FlashgenError
from flashgen.oplib.moe import MOE_GEMM_GATE_UP, MOE_ROUTE, expert_runs, moe_align
from flashgen.runtime.decoder.kv_cache import PagedKVCache
from flashgen.runtime.decoder.linear import PLAIN, CallForm, apply
from flashgen.runtime.decoder.mixed import ModePlan
from flashgen.runtime.decoder.quant_modes import Bf16Linear, QuantLinear, cpu_weight, quant_mode, torch_linear
from flashgen.runtime.serving.torch_ops import dispatcher, register_all
from flashgen.runtime.checkpoints.model_config import ModelConfig
from flashgen.runtime.decoder.moe_experts import Stacked, run_experts, stack_experts
from flashgen.runtime.checkpoints.prequant import mode_of, quant_linear, quantized_tensor, read_linear
from flashgen.runtime.checkpoints.rope_scaling import rope_table
from flashgen.runtime.checkpoints.weights import moe_names


# Up to this many tokens the generated experts take the router's ids as they are (`routing="ids"`);
# more take them aligned: each program's scan of every id would outgrow the alignment's cost.
IDS_ROUTING_MAX_TOKENS = 64
SHORTEST_CONTEXT_BUCKET = 512  # the smallest context a decode step's attention dispatches at


def context_bucket(longest: int, bound: int) -> int:
    """The context L a decode attention whose longest context is `longest` dispatches at, so that its
    schedule is the one tuned for contexts up to about that: `longest` rounded up to a power of two, at
    least SHORTEST_CONTEXT_BUCKET, at most `bound`. A schedule chosen for 8192-token contexts takes 128
    keys a loop step and shares a context among 8 programs: 300-token contexts keep 3 of them busy."""
    return min(bound, max(SHORTEST_CONTEXT_BUCKET, 1 << (longest - 1).bit_length()))


@dataclass
class Batch:
    """The new tokens of several sequences, packed: `lens[i]` tokens of sequence `seqs[i]`, whose
    context (cached prefix + these tokens) is `ctx[i]` long.

    The generated attention reads the block tables and context lengths as device tensors; `forward`
    builds them from the lists when they are not given. A CUDA-graph step gives them (static buffers
    refilled before each replay), and its `seqs` and `ctx` are then unused."""
    tokens: torch.Tensor     # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor      # [T] int64: cache slot of each token
    seqs: list[int]
    lens: list[int]
    ctx: list[int]
    tables: torch.Tensor | None = None    # [B, MAXB] int32: block tables, one width for every step
    ctx_lens: torch.Tensor | None = None  # [B] int32
    context: int | None = None  # a decode step's attention context bucket (`Decoder.attention_context`) if not max(ctx)'s


@dataclass
class MoeBlock:
    """One MoE layer's weights."""
    router: torch.Tensor                            # [experts, hidden], in the decoder's dtype, unquantized
    experts: list[tuple[QuantLinear, QuantLinear]]  # each expert's gate|up and down (the torch path)
    shared: tuple[QuantLinear, QuantLinear] | None = None  # Qwen2-MoE's shared expert's gate|up and down
    shared_gate: torch.Tensor | None = None         # [1, hidden]
    # the generated path's stacked weights, gate|up [E, 2I, hidden] and down [E, hidden, I] in the moe
    # ops' layout of the quant mode (runtime/decoder/moe_experts.py; experts then empty)
    stacked: tuple[Stacked, Stacked] | None = None


class Decoder:
    tp = 1    # the ranks that hold this model's layers (runtime/decoder/tensor_parallel.py), and this one's
    rank = 0

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, quant: str = "bf16"):
        register_all()
        self.c, self.device, self.dtype, self.mode = config, torch.device(device), dtype, quant_mode(quant)
        self.generated_attention = True  # on a GPU; False keeps the torch path (a reference for tests)
        self.fallbacks: set[str] = set()
        if config.prequant is not None:  # the checkpoint's codes decide the mode (runtime/checkpoints/prequant.py)
            stored = mode_of(config.prequant)
            if self.mode not in (Bf16Linear, stored):
                raise FlashgenError(f"a {config.prequant.method} checkpoint computes as {stored.mode}, "
                                    f"not {quant}: its weights are quantized already")
            self.mode = stored
        self.quant = self.mode.mode  # its name, as --quant gives it
        # which mode a mixed linear computes each call in, decided per layer shape as its weights settle
        self.chooser = ModePlan(dispatcher().target_for(self.device), dispatcher().db_path, dtype)
        keep = config.prequant is not None  # (a pre-quantized linear's tensors keep their dtypes: e4m3, fp32 scales)
        w = {k: v.to(self.device, dtype if v.is_floating_point() and not (keep and quantized_tensor(k)) else None)
             for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        # (on the CPU a tied head is a second copy of the embedding, in oneDNN's form: runtime/decoder/linear.py)
        self.lm_head = cpu_weight(self.embed if config.tie_word_embeddings else w["lm_head.weight"])
        self.final_norm = w["model.norm.weight"]
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            att = p + "self_attn."
            layer = {"in_norm": w[p + "input_layernorm.weight"], "post_norm": w[p + "post_attention_layernorm.weight"]}
            linears = {"qkv": [att + n + "_proj" for n in "qkv"], "o": [att + "o_proj"]}
            if config.layer_moe(i):
                layer["moe"] = self._moe_block(w, i)
            else:
                linears.update(gate_up=[p + "mlp.gate_proj", p + "mlp.up_proj"], down=[p + "mlp.down_proj"])
            for name, parts in linears.items():
                layer[name] = self._linear_weights(w, parts, name, self._form(name))
            if config.qkv_bias:
                layer["qkv_bias"] = torch.cat([w[att + n + "_proj.bias"] for n in "qkv"])
            if config.o_bias:
                layer["o_bias"] = w[att + "o_proj.bias"]
            if config.qk_norm:
                layer.update(q_norm=w[att + "q_norm.weight"], k_norm=w[att + "k_norm.weight"])
            if config.mlp_bias:
                layer["gate_up_bias"] = torch.cat([w[p + "mlp.gate_proj.bias"], w[p + "mlp.up_proj.bias"]])
                layer["down_bias"] = w[p + "mlp.down_proj.bias"]
            self.layers.append(layer)
        self.cos_sin: torch.Tensor | None = None  # sized by the first cache it serves (`context`)
        self._rope_positions = 0

    def _form(self, name: str) -> CallForm:
        """How `forward` calls the dense linear `name`: what comes with x (runtime/decoder/linear.py)."""
        c = self.c
        return {"qkv": CallForm(norm=True, bias=c.qkv_bias), "o": CallForm(residual=True, bias=c.o_bias),
                "gate_up": CallForm(norm=True, bias=c.mlp_bias),
                "down": CallForm(gated=True, residual=True, bias=c.mlp_bias)}[name]

    def _linear_weights(self, w: dict[str, torch.Tensor], parts: list[str], name: str, form: CallForm) -> QuantLinear:
        """A decoder linear, its checkpoint linears `parts` stacked along N, called in `form`: float
        weights quantized in the decoder's mode, or a pre-quantized checkpoint's codes repacked
        (runtime/checkpoints/prequant.py)."""
        pq = self.c.prequant
        if pq is None:
            return self._prepare(torch.cat([w[x + ".weight"] for x in parts]) if len(parts) > 1
                                 else w[parts[0] + ".weight"], form)
        ints = [read_linear(w, x + ".", pq, *self._features(x), "the checkpoint") for x in parts]
        return quant_linear(ints, pq, self.dtype, f"{parts[0].rsplit('.', 1)[0]}.{name}")

    def _prepare(self, w: torch.Tensor, form: CallForm = PLAIN) -> QuantLinear:
        """A float weight in the decoder's mode, as it will serve calls in `form` (`QuantLinear.settle`)."""
        return self.mode.prepare(w).settle(self.chooser, form)

    @property
    def notes(self) -> list[str]:
        """Which mode mixed linears compute in at which rows, per layer shape, and why (none in other modes)."""
        return self.chooser.describe()

    def _features(self, linear: str) -> tuple[int, int]:
        """A dense layer's linear (`...q_proj` and so on): its output and input features, as the config says."""
        c = self.c
        q, kv, h, ff = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (ff, h),
                "up_proj": (ff, h), "down_proj": (h, ff)}[linear.rsplit(".", 1)[1]]

    @property
    def moe_weights(self) -> str | None:
        """The moe ops' `weights` attr the experts run with as the generated grouped GEMMs (on a GPU, a
        top-k the ops take, a mode with a stacked form: runtime/decoder/moe_experts.py), or None (torch)."""
        c = self.c
        if self.device.type != "cuda" or str(c.experts_per_tok) not in MOE_GEMM_GATE_UP.attrs["topk"]:
            return None
        return self.mode.stacked_format(c.hidden_size, c.moe_intermediate_size)

    @property
    def generated_moe(self) -> bool:
        return self.moe_weights is not None

    def _moe_block(self, w: dict[str, torch.Tensor], layer: int) -> MoeBlock:
        names = moe_names(self.c, layer)

        def expert(gate: str, up: str, down: str) -> tuple[QuantLinear, QuantLinear]:
            return self._prepare(torch.cat([w[gate], w[up]])), self._prepare(w[down])

        shared = expert(*names.shared) if names.shared else None
        gate = cpu_weight(w[names.router]), shared, cpu_weight(w[names.shared_gate]) if names.shared_gate else None
        if self.generated_moe:  # stacked, each expert's own tensors let go as it is quantized or copied
            experts = [(lambda g=g, u=u: torch.cat([w.pop(g), w.pop(u)]), lambda d=d: w.pop(d))
                       for g, u, d in names.experts]
            return MoeBlock(gate[0], [], gate[1], gate[2], stacked=stack_experts(experts, self.mode))
        return MoeBlock(gate[0], [expert(*e) for e in names.experts], *gate[1:])

    @property
    def capturable(self) -> bool:
        """Whether a decode step can be captured in a CUDA graph: not with MoE layers whose torch
        routing reads each expert's token count on the host."""
        return not any(self.c.moe_layers) or self.generated_moe

    # ---- building blocks ------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, w: QuantLinear, bias: torch.Tensor | None = None,
               norm: torch.Tensor | None = None, gated: bool = False,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """A layer's linear in the decoder's quantization mode, with the RMSNorm or SiLU·mul that feeds
        it and the residual it adds (see runtime/decoder/linear.py)."""
        if self.device.type != "cuda":
            self.fallbacks.add("linear (torch on cpu: the gemm ops are generated for GPUs)")
        return apply(x, w, bias, self.fallbacks, self.chooser, norm, self.c.rms_norm_eps, gated, residual)

    def moe(self, h: torch.Tensor, b: MoeBlock) -> torch.Tensor:
        """The MoE MLP of the normed hidden states `h` [T, hidden]: each token's top-k experts (softmax
        over all experts, renormalised over the k if the config says so), weighted and summed, plus the
        gated shared expert if any (module docstring). A token whose router logits hold a NaN or +inf
        gets NaN weights (flashgen/oplib/moe.py), so its output is NaN and the engine fails its request
        naming the step, never a finite output from experts the NaN left out."""
        c = self.c
        logits = torch_linear(h, b.router).float()
        if str(c.experts_per_tok) in MOE_ROUTE.attrs["topk"]:  # the generated router: softmax, top-k, renorm
            chosen, weights = torch.ops.flashgen.moe_route(logits.contiguous(), topk=str(c.experts_per_tok),
                                                           renorm="yes" if c.norm_topk_prob else "no")
        else:
            self.fallbacks.add(f"moe router (torch: top-{c.experts_per_tok} is not generated)")
            weights, chosen = logits.softmax(-1).topk(c.experts_per_tok, dim=-1)
            if c.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        if b.stacked is not None:
            out = self._generated_experts(h, b.stacked, chosen, weights.float())
        else:
            out = self._torch_experts(h, b.experts, chosen, weights)
        if b.shared is not None:
            gate_up, down = b.shared
            shared = self.linear(self.linear(h, gate_up), down, gated=True)
            out += torch.sigmoid(torch_linear(h, b.shared_gate)) * shared
        return out

    def _generated_experts(self, h: torch.Tensor, stacked: tuple[Stacked, Stacked], chosen: torch.Tensor,
                           weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum by the generated grouped GEMMs (module docstring)."""
        if h.shape[0] <= IDS_ROUTING_MAX_TOKENS:  # each program finds its pairs in the ids: no alignment launched
            routing = {"routing": "ids", "topk_ids": chosen}
        else:
            pairs, offsets = moe_align(chosen, self.c.num_experts)
            routing = {"sorted_pairs": pairs, "expert_offsets": offsets}
        attrs = {"topk": str(self.c.experts_per_tok), "weights": self.moe_weights}
        return run_experts(torch.ops.flashgen, h, stacked, routing, weights.flatten().contiguous(), attrs,
                           self.mode.activations).to(h.dtype)

    def _torch_experts(self, h: torch.Tensor, experts: list[tuple[QuantLinear, QuantLinear]], chosen: torch.Tensor,
                       weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum in torch: each expert's tokens gathered and run through its
        linears (the expert loop reads each expert's token count on the host)."""
        self.fallbacks.add("moe experts (torch)")
        k = self.c.experts_per_tok
        weights = weights.flatten().to(h.dtype)
        out = torch.zeros_like(h)
        # the (token, slot) pairs grouped by expert, in token order; a pair of no expert is in no run
        for e, pairs in expert_runs(*moe_align(chosen, self.c.num_experts)):
            gate_up, down = experts[e]
            tokens = pairs // k
            y = self.linear(self.linear(h[tokens], gate_up), down, gated=True)
            out.index_add_(0, tokens, y * weights[pairs, None])
        return out

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: PagedKVCache, layer: int,
                  batch: Batch,
                  keys: tuple[Callable[[torch.Tensor], torch.Tensor], dict[int | None, torch.Tensor]] | None = None
                  ) -> torch.Tensor:
        """Each sequence's new queries against its whole cached context (the new keys already written),
        causal, sliding window if any: the generated paged-decode or chunked-prefill kernel on a GPU.
        `keys` (`decode_keys`, once per step) lets a torch decode step skip rebuilding its cache index."""
        if self.uses_tables:
            return self._generated_attention(q, k, v, cache, layer, batch)
        if all(n == 1 for n in batch.lens):
            return self._torch_decode_attention(q, cache, layer, keys or self.decode_keys(batch, cache))
        return self._torch_attention(q, cache, layer, batch)

    @property
    def uses_tables(self) -> bool:
        """Whether attention runs the generated kernels, which read device block tables."""
        return self.device.type == "cuda" and self.generated_attention

    def context(self, cache: PagedKVCache) -> int:
        """The longest context a sequence can reach: the model's, or what the cache holds if less (a
        config may claim 10^9 positions; nothing is sized from that)."""
        m = cache.manager
        return min(self.c.max_position_embeddings, m.num_blocks * m.block_size)

    def rope(self, cache: PagedKVCache) -> torch.Tensor:
        """The cos|sin table for every position `cache` can reach, built once (a CUDA graph holds it)."""
        need = self.context(cache)
        if self.cos_sin is None or self._rope_positions < need:
            self.cos_sin, self._rope_positions = rope_table(self.c, need).to(self.device), need
        return self.cos_sin

    def attention_context(self, longest: int, cache: PagedKVCache) -> int:
        """L, the context a decode step's attention dispatches at (`context_bucket` of the step's
        `longest` context), at most what a table or the whole cache holds."""
        return context_bucket(longest, min(self.table_width(cache), cache.k[0].shape[0]) * cache.manager.block_size)

    def table_width(self, cache: PagedKVCache) -> int:
        """Block-table width: a whole context, so every step of a run is one workload (no new dispatch)
        and a CUDA graph's tables fit any sequence."""
        return cache.manager.blocks_for(self.context(cache))

    def with_tables(self, batch: Batch, cache: PagedKVCache) -> Batch:
        """`batch` with its block tables and context lengths on the device."""
        rows = cache.manager.padded_tables(batch.seqs, self.table_width(cache))
        return replace(batch, tables=torch.tensor(rows, dtype=torch.int32, device=self.device),
                       ctx_lens=torch.tensor(batch.ctx, dtype=torch.int32, device=self.device))

    def _generated_attention(self, q, k, v, cache, layer, batch) -> torch.Tensor:
        c, m = self.c, cache.manager
        table, ctx = batch.tables, batch.ctx_lens
        kc, vc = cache.k[layer], cache.v[layer]
        mod = {"mod": "window"} if c.layer_window(layer) else {}
        window = float(c.layer_window(layer) or 1024)
        if all(n == 1 for n in batch.lens):
            width = table.shape[1]
            longest = batch.context or self.attention_context(max(batch.ctx), cache)
            dims = [len(batch.lens), c.num_heads, c.num_kv_heads, c.head_dim, m.block_size, kc.shape[0], width, longest]
            return torch.ops.flashgen.paged_decode_attention(q, kc, vc, table, ctx, None, window, dims=dims, **mod)
        cu = torch.tensor([0] + list(torch.tensor(batch.lens).cumsum(0)), dtype=torch.int32, device=self.device)
        prefix = ctx - torch.tensor(batch.lens, dtype=torch.int32, device=self.device)
        return torch.ops.flashgen.chunked_prefill_attention(q, k, v, cu, kc, vc, table, prefix, None, window, **mod)

    def decode_keys(self, batch: Batch, cache: PagedKVCache
                    ) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict[int | None, torch.Tensor]]:
        """For a torch decode step, the same for every layer: how to take every sequence's first W cache
        blocks out of a layer's [blocks, block_size, Hkv, D] tensor as one [B, W * block_size, Hkv, D]
        tensor, and which of those slots each query sees, [B, 1, 1, W * block_size] (its context,
        within the sliding window if any), by each window the layers use. Blocks reserved together lie in runs evenly spaced (a
        request reserves its prompt and new tokens at once): those are taken as a view, no gather; other
        tables are gathered through an index."""
        m, c = cache.manager, self.c
        width, bs = max(m.blocks_for(n) for n in batch.ctx), m.block_size
        rows = [m.tables[s][:width] for s in batch.seqs]  # (a table may hold blocks reserved for later tokens)
        starts = [r[0] for r in rows]
        step = starts[1] - starts[0] if len(starts) > 1 else 0
        if step >= 0 and all(r == list(range(s, s + width)) for r, s in zip(rows, starts)) and \
                all(b - a == step for a, b in zip(starts, starts[1:])):
            def select(x: torch.Tensor) -> torch.Tensor:
                block = x[0].numel()
                return x.as_strided((len(rows), width * bs, *x.shape[2:]), (step * block, *x.stride()[1:]),
                                    x.storage_offset() + starts[0] * block)
        else:
            index = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=self.device)

            def select(x: torch.Tensor) -> torch.Tensor:
                return x[index].reshape(len(rows), width * bs, *x.shape[2:])
        kpos = torch.arange(width * bs, device=self.device)[None, :]
        ctx = torch.tensor(batch.ctx, device=self.device)[:, None]
        seen = {}
        for window in {c.layer_window(i) for i in range(c.num_layers)}:
            mask = kpos < ctx
            if window:
                mask &= kpos >= ctx - window
            seen[window] = mask[:, None, None, :]
        return select, seen

    def _torch_decode_attention(self, q: torch.Tensor, cache: PagedKVCache, layer: int,
                                keys: tuple[Callable[[torch.Tensor], torch.Tensor], dict[int | None, torch.Tensor]]
                                ) -> torch.Tensor:
        """One query per sequence, all sequences in one call: the query heads sharing a KV head are that
        head's rows (grouped-query attention without repeating keys). The slots a query does not see
        (past its context, before its window, in the blocks a padded table names) hold whatever was
        written there last, NaN or inf included: their keys and values are replaced by zeros, not
        only given weight 0, since a masked score of NaN stays NaN and 0 x NaN is NaN."""
        self.fallbacks.add("attention (torch over the paged cache)")
        c = self.c
        select, seen = keys
        b, group = q.shape[0], c.num_heads // c.num_kv_heads
        mask = seen[c.layer_window(layer)]
        slots = mask.reshape(b, -1, 1, 1)  # [B, W * block_size, 1, 1]: each slot's keys and values
        o = F.scaled_dot_product_attention(q.reshape(b, c.num_kv_heads, group, c.head_dim),
                                           torch.where(slots, select(cache.k[layer]), 0).transpose(1, 2),
                                           torch.where(slots, select(cache.v[layer]), 0).transpose(1, 2),
                                           attn_mask=mask)
        return o.reshape(b, c.num_heads, c.head_dim)

    def _torch_attention(self, q, cache, layer, batch) -> torch.Tensor:
        """Sequence by sequence, its new queries against its own first ctx cache positions, sliced out of
        its blocks: no slot past its context is read, whatever it holds."""
        c = self.c
        self.fallbacks.add("attention (torch over the paged cache)")
        out = torch.empty_like(q)
        start = 0
        for seq, n, ctx in zip(batch.seqs, batch.lens, batch.ctx):
            blocks = torch.tensor(cache.manager.tables[seq][: cache.manager.blocks_for(ctx)], device=self.device)
            k = cache.k[layer][blocks].reshape(-1, c.num_kv_heads, c.head_dim)[:ctx]
            v = cache.v[layer][blocks].reshape(-1, c.num_kv_heads, c.head_dim)[:ctx]
            qpos = torch.arange(ctx - n, ctx, device=self.device)[:, None]
            kpos = torch.arange(ctx, device=self.device)[None, :]
            mask = kpos <= qpos
            if c.layer_window(layer):
                mask &= kpos > qpos - c.layer_window(layer)
            o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), k.transpose(0, 1),
                                               v.transpose(0, 1), attn_mask=mask, enable_gqa=True)
            out[start:start + n] = o.transpose(0, 1)
            start += n
        return out

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, batch: Batch, cache: PagedKVCache, last_only: bool = True) -> torch.Tensor:
        """Logits of each sequence's last new token (or of every new token). With every device tensor
        of `batch` given and one token per sequence, this is capturable in a CUDA graph."""
        c = self.c
        if self.uses_tables and batch.tables is None:
            batch = self.with_tables(batch, cache)
        x = self.embed[batch.tokens]  # the residual stream: each linear into it adds it in its epilogue
        decode = not self.uses_tables and all(n == 1 for n in batch.lens)
        keys = self.decode_keys(batch, cache) if decode else None
        cos_sin = self.rope(cache)
        for i, L in enumerate(self.layers):
            qkv = self.linear(x, L["qkv"], L.get("qkv_bias"), norm=L["in_norm"])
            nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            q = qkv[:, :nq].reshape(-1, c.num_heads, c.head_dim)
            k = qkv[:, nq:nq + nk].reshape(-1, c.num_kv_heads, c.head_dim)
            v = qkv[:, nq + nk:].reshape(-1, c.num_kv_heads, c.head_dim)  # (views: the kernels take row strides)
            if c.qk_norm:  # Qwen3: each head RMS-normalised over its head_dim
                q = torch.ops.flashgen.rmsnorm(q.reshape(-1, c.head_dim), L["q_norm"], c.rms_norm_eps).view(q.shape)
                k = torch.ops.flashgen.rmsnorm(k.reshape(-1, c.head_dim), L["k_norm"], c.rms_norm_eps).view(k.shape)
            q, k = torch.ops.flashgen.rope_cache(q, k, batch.positions, cos_sin, v,
                                                 batch.slots, *cache.slot_views(i))
            a = self.attention(q, k, v, cache, i, batch, keys).reshape(-1, nq)
            x = self.row_linear(a, L["o"], L.get("o_bias"), residual=x)
            if "moe" in L:
                x = x + self.moe(torch.ops.flashgen.rmsnorm(x, L["post_norm"], c.rms_norm_eps), L["moe"])
            else:
                up = self.linear(x, L["gate_up"], L.get("gate_up_bias"), norm=L["post_norm"])
                x = self.row_linear(up, L["down"], L.get("down_bias"), gated=True, residual=x)
        h = torch.ops.flashgen.rmsnorm(x, self.final_norm, c.rms_norm_eps)
        if last_only and h.shape[0] != len(batch.lens):  # (one token per sequence: each is its last)
            ends = torch.tensor(batch.lens, device=self.device).cumsum(0) - 1
            h = h[ends]
        return self.logits(h)

    def row_linear(self, x: torch.Tensor, w: QuantLinear, bias: torch.Tensor | None = None, gated: bool = False,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
        """A linear whose output joins the residual stream (o, down): computed whole here; a
        tensor-parallel rank sums its partial product with the other ranks' (runtime/decoder/tensor_parallel.py)."""
        return self.linear(x, w, bias, gated=gated, residual=residual)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The lm_head of the final hidden states: every row's logits over the whole vocabulary."""
        return torch_linear(h, self.lm_head)
