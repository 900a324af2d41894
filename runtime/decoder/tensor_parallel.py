"""Tensor-parallel decoding: one process (rank) per GPU, each holding a slice of every layer, in
Megatron's layout.

The q, k and v projections and the gate|up projection are split by output rows (column-parallel), the
o and down projections by input columns (row-parallel), so each attention head and each intermediate
feature lives on one rank and a layer needs two all-reduces, after o and after down. Rank 0 adds the
residual (and the bias) in its GEMM's epilogue and the others add nothing, so the all-reduce's sum is
the new residual stream. Query heads are split evenly; a GQA group stays whole on one rank with its KV
head, and where the model has fewer KV heads than ranks, each KV head is replicated on the ranks of its
group. The lm_head is split by vocabulary rows (padded with zero rows to a multiple of the ranks) and
its logits are all-gathered; the embedding and the norms are replicated.

Weights are sliced in float, before the decoder quantizes them, so each rank's linears are quantized
on their own shapes (N / tp or K / tp) and its GEMM workloads are those shapes in the database. A
column-parallel slice keeps its rows' per-channel scales; a row-parallel slice's scales cover its K
slice only, so quantized modes compute close to one process, not bit for bit.

Every rank runs the same engine on the same requests, so admission and block tables agree without a
message; rank 0 samples and broadcasts a sampling step's tokens (`agree`; runtime/decoder/engine.py says why
greedy steps need no message). Collectives go through
torch.distributed (runtime/decoder/ranks.py starts the group) with a timeout: a rank that dies or stalls makes
the others fail in one line (`PeerFailure`, a FlashgenError), never hang.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from flashgen.errors import FlashgenError, one_line
from flashgen.runtime.decoder.quant_modes import QuantLinear
from flashgen.runtime.decoder.model import Decoder
from flashgen.runtime.checkpoints.model_config import ModelConfig
from flashgen.runtime.decoder.ranks import PeerFailure
from flashgen.runtime.checkpoints.weights import load_weights

COLUMN_PARALLEL = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "ff", "up_proj": "ff"}
ROW_PARALLEL = {"o_proj": "q", "down_proj": "ff"}
NO_TOKEN, SAMPLING_FAILED = -1, -2  # `agree`'s codes besides token ids


def check_tp(c: ModelConfig, tp: int) -> None:
    """Refuses, in one line, a degree the model's layers cannot be split into (module docstring)."""
    if not isinstance(tp, int) or tp < 1:
        raise FlashgenError(f"tp must be an integer of at least 1, got {tp!r}")
    if tp == 1:
        return
    if c.num_experts or any(c.moe_layers):
        raise FlashgenError(f"tp={tp}: tensor parallelism splits dense layers; this {c.model_type} model has MoE layers")
    if c.prequant is not None:
        raise FlashgenError(f"tp={tp}: a pre-quantized checkpoint cannot be split yet; split a float checkpoint "
                            "and quantize it at load (quant=)")
    if c.num_heads % tp:
        raise FlashgenError(f"tp={tp} does not divide the model's {c.num_heads} attention heads")
    if c.num_kv_heads % tp and tp % c.num_kv_heads:
        raise FlashgenError(f"tp={tp} neither divides the model's {c.num_kv_heads} KV heads nor is a multiple of "
                            "them: a GQA group must stay whole on one rank")
    if c.intermediate_size % tp:
        raise FlashgenError(f"tp={tp} does not divide the model's intermediate size {c.intermediate_size}")


def check_gpus(tp: int, gpus: int) -> None:
    """Refuses more GPU ranks than GPUs: each rank takes one of its own."""
    if tp > gpus:
        raise FlashgenError(f"tp={tp} needs {tp} GPUs, one per rank; this machine has {gpus}")


def shard_config(c: ModelConfig, tp: int) -> ModelConfig:
    """What one rank computes: its heads and intermediate features, its own lm_head slice (untied)."""
    return replace(c, num_heads=c.num_heads // tp, num_kv_heads=max(c.num_kv_heads // tp, 1),
                   intermediate_size=c.intermediate_size // tp, tie_word_embeddings=False)


def _rows(c: ModelConfig, tp: int, rank: int) -> dict[str, slice]:
    """The rows (of a column-parallel weight; columns of a row-parallel one) that `rank` holds, by kind."""
    local = shard_config(c, tp)
    hq, hkv, d, ff = local.num_heads, local.num_kv_heads, c.head_dim, local.intermediate_size
    kv0 = rank * hq // (c.num_heads // c.num_kv_heads)  # the KV head of the rank's first query head
    return {"q": slice(rank * hq * d, (rank + 1) * hq * d), "kv": slice(kv0 * d, (kv0 + hkv) * d),
            "ff": slice(rank * ff, (rank + 1) * ff)}


def vocab_rows(vocab: int, tp: int) -> int:
    """Rows of each rank's lm_head slice: the vocabulary padded to a multiple of tp, split."""
    return -(-vocab // tp)


def _index(c: ModelConfig, tp: int, rank: int, name: str) -> tuple[slice, ...] | None:
    """The part of checkpoint tensor `name` that `rank` holds, or None for all of it (replicated)."""
    proj, kind = name.rsplit(".", 2)[-2:]
    rows = _rows(c, tp, rank)
    if name == "lm_head.weight":
        n = vocab_rows(c.vocab_size, tp)
        return (slice(rank * n, (rank + 1) * n),)
    if proj in COLUMN_PARALLEL:
        return (rows[COLUMN_PARALLEL[proj]],)
    if proj in ROW_PARALLEL and kind == "weight":  # (o and down biases stay whole: rank 0 adds them)
        return (slice(None), rows[ROW_PARALLEL[proj]])
    return None


def shard_weights(c: ModelConfig, weights: dict[str, torch.Tensor] | str | Path, tp: int,
                  rank: int) -> dict[str, torch.Tensor]:
    """`rank`'s tensors under the checkpoint's names, for a decoder of `shard_config(c, tp)`: sliced from
    the whole model's tensors (copies, so those can be let go), or read from a checkpoint folder, only
    this rank's part of each tensor."""
    take = partial(_index, c, tp, rank)
    if isinstance(weights, dict):
        out = {name: t if (i := take(name)) is None else t[i].clone() for name, t in weights.items()}
    else:
        out = load_weights(weights, c, take)
    if c.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"][take("lm_head.weight")]
    part, n = out["lm_head.weight"], vocab_rows(c.vocab_size, tp)
    out["lm_head.weight"] = torch.cat([part, part.new_zeros(n - part.shape[0], part.shape[1])])
    return out


def _collective(what: str, run, rank: int) -> None:
    """Runs one collective; a peer that died or timed out is one line naming this rank (a PeerFailure:
    the launcher stops the others at once, runtime/decoder/ranks.py)."""
    try:
        run()
    except (RuntimeError, dist.DistError) as e:
        raise PeerFailure(f"rank {rank}: {what} failed: another rank died or did not answer in time "
                            f"({one_line(e)[:300]})") from None


class ShardedDecoder(Decoder):
    """This rank's part of a tensor-parallel decoder, built from the whole model's float `weights`, or read
    from a checkpoint folder (module docstring), in `group` (the default: every rank), which must be up
    (runtime/decoder/ranks.py). Its forward returns every row's logits over the whole vocabulary, the same on
    every rank."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor] | str | Path,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, quant: str = "bf16",
                 group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise FlashgenError("a ShardedDecoder runs in each rank of a process group: launch it with torchrun "
                                "or flashgen.runtime.decoder.ranks.launch")
        tp = dist.get_world_size(group)
        check_tp(config, tp)
        self.tp, self.rank, self.group = tp, dist.get_rank(group), group
        super().__init__(shard_config(config, tp), shard_weights(config, weights, tp, self.rank), device, dtype,
                         quant)

    def row_linear(self, x: torch.Tensor, w: QuantLinear, bias: torch.Tensor | None = None, gated: bool = False,
                   residual: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's partial product, rank 0's with the bias and residual, summed over the ranks."""
        lead = self.rank == 0
        y = self.linear(x, w, bias if lead else None, gated=gated, residual=residual if lead else None)
        _collective("all-reduce", lambda: dist.all_reduce(y, group=self.group), self.rank)
        return y

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Each rank's vocabulary slice, all-gathered, the padding rows cut off."""
        local = super().logits(h).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        _collective("all-gather", lambda: dist.all_gather(parts, local, group=self.group), self.rank)
        return torch.cat(parts, -1)[:, :self.c.vocab_size]


def agree(picks: list[int | str | None], model: ShardedDecoder) -> list[int | str | None]:
    """Rank 0's picks of a step on every rank: each request's token, None (no token: it was done), or why
    its sampling failed (the other ranks read rank 0's reason as a fixed line)."""
    codes = [p if isinstance(p, int) else NO_TOKEN if p is None else SAMPLING_FAILED for p in picks]
    t = torch.tensor(codes, dtype=torch.int64, device=model.device)
    src = 0 if model.group is None else dist.get_global_rank(model.group, 0)
    _collective("broadcast of the tokens", lambda: dist.broadcast(t, src, group=model.group), model.rank)
    if model.rank == 0:
        return picks
    return [None if x == NO_TOKEN else "sampling failed (on rank 0)" if x == SAMPLING_FAILED else x
            for x in t.tolist()]
