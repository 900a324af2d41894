"""Decode steps replayed from CUDA graphs.

A decode step launches a few kernels per layer (about 400 for Llama-3-8B); launched one by one from
Python they cost more host time than the GPU needs to run them at small batches. A step in which every
sequence brings one token is therefore captured once per padded batch size (a bucket: 1, 2, 4, ...)
and attention context bucket (`Decoder.attention_context`: the longest context rounded up to a power of
two, whose tuned attention schedule the graph holds), the first time such a step comes, over static
input buffers that every context bucket of a batch size shares; each later step copies its inputs
into them (one host-to-device copy, plus one of the block tables when the set of sequences changed)
and replays. Padding rows take token 0 at position 0, write into the cache's pad block and attend to
that one slot, so they never touch a real sequence. All buckets share one graph memory pool.

Each replay ends by writing every row's greedy token into its own token row, so that the next step of
the same sequences can be replayed before the host has read those tokens (`run` with `tokens=None`):
the host then only copies positions, slots and context lengths, which it knows in advance.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field

import torch

from flashgen.runtime.decoder.kv_cache import PagedKVCache
from flashgen.runtime.decoder.model import Batch, Decoder
from flashgen.runtime.serving.graphs import cuda_graph

MAX_BATCH = 256  # larger decode steps run eagerly


def _chunk(vocab: int) -> int:
    """The largest divisor of `vocab` up to 1024: the length of the first reduction's pieces."""
    return next(c for c in range(min(vocab, 1024), 0, -1) if vocab % c == 0)


NON_FINITE = -1  # `greedy`'s token for a row whose logits hold a NaN or +inf


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its first highest logit, [rows] int64, as torch.argmax gives it, in two
    reductions (every chunk's max, then the best chunk): torch reduces one long row in a single block
    (36 us for a 128k vocabulary on an H200), the chunks in many. A row whose logits hold a NaN or +inf
    gets NON_FINITE instead of the 0 argmax would read from NaNs; the chunk maxima show both (max
    propagates NaN), so the check reads [rows, vocab / chunk] values, not the logits again."""
    rows, vocab = logits.shape
    chunk = _chunk(vocab)
    best, at = logits.reshape(rows, vocab // chunk, chunk).max(-1)  # max(dim) returns the first maximum, too
    which = best.argmax(-1, keepdim=True)
    tokens = (at.gather(-1, which) + which * chunk).squeeze(-1)
    return tokens.masked_fill(~(best < math.inf).all(-1), NON_FINITE)  # (NaN < inf is false)


def buckets(max_batch: int) -> list[int]:
    """The padded batch sizes: powers of two below max_batch, and max_batch."""
    sizes = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
    return sizes + [max_batch]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding n sequences; None when n is past the largest."""
    return next((b for b in sizes if b >= n), None)


def padded_inputs(tokens: list[int], positions: list[int], slots: list[int], rows: int,
                  pad_slot: int) -> list[list[int]]:
    """A decode step's tokens, positions, slots and context lengths (position + 1), padded to `rows`:
    padding rows hold token 0 at position 0 in `pad_slot`, a context of one token."""
    pad = rows - len(tokens)
    return [tokens + [0] * pad, positions + [0] * pad, slots + [pad_slot] * pad,
            [p + 1 for p in positions] + [1] * pad]


def input_columns(b: int) -> int:
    """Columns of a bucket's [4, columns] int64 input buffer: even, so that each row starts 16-byte
    aligned, as the kernels' binaries assume of every pointer."""
    return b + b % 2


@dataclass
class _Replay:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor   # [b, vocab]
    chosen: torch.Tensor   # [b] int64: `greedy`'s tokens, NON_FINITE marks kept (the inputs hold them cleared)


@dataclass
class _Graph:
    """A batch bucket's input buffers and its graphs, one per attention context bucket."""
    inputs: torch.Tensor   # [4, input_columns(b)] int64: tokens, positions, slots, context lengths
    tables: torch.Tensor   # [b, width] int32
    replays: dict[int, _Replay] = field(default_factory=dict)
    last: _Replay | None = None  # the one replayed last: its `chosen` are the bucket's latest tokens
    rows: tuple[tuple[int, int], ...] = ()  # (sequence, blocks) whose tables `tables` holds


class DecodeGraphs:
    """CUDA graphs of one-token-per-sequence steps of `model` over `cache` (which needs a pad block)."""

    def __init__(self, model: Decoder, cache: PagedKVCache, max_batch: int = MAX_BATCH):
        self.model, self.cache = model, cache
        self.sizes = buckets(max_batch)
        self.graphs: dict[int, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        m = cache.manager
        self.pad_slot = m.pad * m.block_size
        self.width = model.table_width(cache)

    def fits(self, n: int) -> bool:
        return bucket_for(n, self.sizes) is not None

    def run(self, seqs: list[int], tokens: list[int] | None, positions: list[int], slots: list[int]) -> torch.Tensor:
        """Logits [len(seqs), vocab] of one decode step; valid until the next replay of any bucket.
        `tokens=None` takes the tokens that the previous replay of this bucket chose for the same
        sequences, still on the device (`chosen`)."""
        b = bucket_for(len(seqs), self.sizes)
        g = self.graphs.get(b) or self._buffers(b)
        context = self.model.attention_context(max(positions) + 1, self.cache)
        replay = g.replays.get(context) or self._capture(b, g, context)
        pin = self.model.device.type == "cuda"  # (pinned host memory needs a GPU)
        host = torch.tensor(padded_inputs(tokens or [0] * len(seqs), positions, slots, input_columns(b),
                                          self.pad_slot), dtype=torch.int64, pin_memory=pin)
        first = 0 if tokens is not None else 1
        g.inputs[first:].copy_(host[first:], non_blocking=True)  # the pinned block is not reused before this copy ran
        rows = tuple((s, len(self.cache.manager.tables[s])) for s in seqs)
        if rows != g.rows:
            tables = self.cache.manager.padded_tables(seqs, self.width, b)
            g.tables.copy_(torch.tensor(tables, dtype=torch.int32, pin_memory=pin), non_blocking=True)
            g.rows = rows
        replay.graph.replay()
        g.last = replay
        return replay.logits[:len(seqs)]

    def prepare(self, n: int, longest: int) -> None:
        """Capture the step of `n` sequences (its bucket's) at every attention context bucket up to that
        of `longest` tokens, ahead of the steps that need them: a capture while serving holds up every
        running request for as long as it takes."""
        b = bucket_for(n, self.sizes)
        g = self.graphs.get(b) or self._buffers(b)
        last, context = self.model.attention_context(longest, self.cache), 0
        while context < last:
            context = self.model.attention_context(context + 1, self.cache)
            if context not in g.replays:
                self._capture(b, g, context)

    def chosen(self, n: int) -> torch.Tensor:
        """The greedy tokens [n] (int64, on the device; NON_FINITE marks a row whose logits are not) of the
        last replay of the bucket of n sequences."""
        return self.graphs[bucket_for(n, self.sizes)].last.chosen[:n]

    def _buffers(self, b: int) -> _Graph:
        """The bucket's static inputs, padding only until a step fills them."""
        dev = self.model.device
        inputs = torch.tensor(padded_inputs([], [], [], input_columns(b), self.pad_slot), dtype=torch.int64,
                              device=dev)
        tables = torch.tensor(self.cache.manager.padded_tables([], self.width, b), dtype=torch.int32, device=dev)
        self.graphs[b] = _Graph(inputs, tables)
        return self.graphs[b]

    def _capture(self, b: int, g: _Graph, context: int) -> _Replay:
        """Capture the bucket's step at attention context `context` over padding-only inputs, after a
        warm-up call of the same shapes (which builds or loads its kernels and fills the dispatcher's
        caches: capture allows neither). The buffers' contents are kept around it: a chained replay
        reads the tokens the last replay wrote into them."""
        kept = g.inputs.clone()
        g.inputs.copy_(torch.tensor(padded_inputs([], [], [], input_columns(b), self.pad_slot), dtype=torch.int64))
        g.tables.copy_(torch.tensor(self.cache.manager.padded_tables([], self.width, b), dtype=torch.int32))
        g.rows = ()

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            tokens, positions, slots, ctx = g.inputs[:, :b]
            batch = Batch(tokens, positions, slots, [], [1] * b, [], tables=g.tables, ctx_lens=ctx.to(torch.int32),
                          context=context)
            logits = self.model.forward(batch, self.cache)
            chosen = greedy(logits)
            tokens.copy_(chosen.clamp(min=0))  # the next step's tokens (a replay with tokens=None): ids the embedding holds
            return logits, chosen

        graph, (logits, chosen) = cuda_graph(step, self.model.device, self.pool)
        g.inputs.copy_(kept)
        g.replays[context] = _Replay(graph, logits, chosen)
        return g.replays[context]
