"""Decode steps replayed from CUDA graphs.

A decode step launches a few kernels per layer (about 400 for Llama-3-8B); launched one by one from
Python they cost more host time than the GPU needs to run them at small batches. A step in which every
sequence brings one token is therefore captured once per padded batch size (a bucket: 1, 2, 4, ...),
the first time a step of that size comes, over static input buffers; each later step copies its inputs
into them (one host-to-device copy, plus one of the block tables when the set of sequences changed)
and replays. Padding rows take token 0 at position 0, write into the cache's pad block and attend to
that one slot, so they never touch a real sequence. All buckets share one graph memory pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flashgen.runtime.kv_cache import PagedKVCache
from flashgen.runtime.model import Batch, Decoder
from flashgen.schedules.timing import cuda_graph

MAX_BATCH = 256  # larger decode steps run eagerly


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
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor   # [4, input_columns(b)] int64: tokens, positions, slots, context lengths
    tables: torch.Tensor   # [b, width] int32
    logits: torch.Tensor   # [b, vocab]
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

    def run(self, seqs: list[int], tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Logits [len(seqs), vocab] of one decode step; valid until the next replay of any bucket."""
        b = bucket_for(len(seqs), self.sizes)
        g = self.graphs.get(b) or self._capture(b)
        host = torch.tensor(padded_inputs(tokens, positions, slots, input_columns(b), self.pad_slot),
                            dtype=torch.int64, pin_memory=True)
        g.inputs.copy_(host, non_blocking=True)  # the pinned block is not reused before this copy ran
        rows = tuple((s, len(self.cache.manager.tables[s])) for s in seqs)
        if rows != g.rows:
            tables = self.cache.manager.padded_tables(seqs, self.width, b)
            g.tables.copy_(torch.tensor(tables, dtype=torch.int32, pin_memory=True), non_blocking=True)
            g.rows = rows
        g.graph.replay()
        return g.logits[:len(seqs)]

    def _capture(self, b: int) -> _Graph:
        """Capture the bucket's step over padding-only inputs, after a warm-up call of the same shapes
        (which builds or loads its kernels and fills the dispatcher's caches: capture allows neither)."""
        dev = self.model.device
        inputs = torch.tensor(padded_inputs([], [], [], input_columns(b), self.pad_slot), dtype=torch.int64,
                              device=dev)
        tables = torch.tensor(self.cache.manager.padded_tables([], self.width, b), dtype=torch.int32, device=dev)

        def step() -> torch.Tensor:
            tokens, positions, slots, ctx = inputs[:, :b]
            batch = Batch(tokens, positions, slots, [], [1] * b, [], tables=tables, ctx_lens=ctx.to(torch.int32))
            return self.model.forward(batch, self.cache)

        graph, logits = cuda_graph(step, dev, self.pool)
        self.graphs[b] = _Graph(graph, inputs, tables, logits)
        return self.graphs[b]
