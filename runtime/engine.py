"""Batched generation: requests join and leave between steps; each step runs one forward over the
prefills of newly admitted requests and one decode token of every running one.

A request is admitted when the cache can hold its prompt plus its remaining new tokens; one that could
never fit is refused with a clear error, and the others go on unharmed. Sampling is greedy
(temperature 0) or by temperature, top-k and top-p, with a per-request seed; a request ends at a stop
token or after max_new_tokens. On a GPU, steps in which every sequence brings one token replay CUDA
graphs (runtime/graphs.py); steps with prefills run eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashgen.errors import FlashgenError
from flashgen.runtime.graphs import DecodeGraphs
from flashgen.runtime.kv_cache import PagedKVCache
from flashgen.runtime.model import Batch, Decoder


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    error: str = ""
    generator: torch.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return bool(self.error) or len(self.output) >= self.params.max_new_tokens or \
            (bool(self.output) and self.output[-1] in self.params.stop_tokens)


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """A token drawn at temperature p.temperature > 0 (greedy rows are picked in `Engine.step`)."""
    logits = logits.float() / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if p.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < p.top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


class Engine:
    def __init__(self, model: Decoder, num_blocks: int = 256, block_size: int = 16, cuda_graphs: bool = True):
        """`cuda_graphs` applies when the model runs its generated attention on a GPU; it keeps one cache
        block for the graphs' padding rows."""
        c = model.c
        self.model = model
        graphs = cuda_graphs and model.uses_tables
        self.cache = PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, model.dtype,
                                  model.device, pad_block=graphs)
        self.graphs = DecodeGraphs(model, self.cache) if graphs else None
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self._next_id = 0

    def add(self, prompt: list[int], params: SamplingParams = SamplingParams()) -> int:
        rid, self._next_id = self._next_id, self._next_id + 1
        req = Request(rid, list(prompt), params, generator=torch.Generator().manual_seed(params.seed))
        c, m = self.model.c, self.cache.manager
        if not prompt:
            req.error = "empty prompt"
        elif len(prompt) + params.max_new_tokens > c.max_position_embeddings:
            req.error = (f"prompt of {len(prompt)} tokens + {params.max_new_tokens} new exceeds the model's context "
                         f"of {c.max_position_embeddings}")
        elif m.blocks_for(len(prompt) + params.max_new_tokens) > len(m.free) + sum(map(len, m.tables.values())):
            req.error = "prompt + max_new_tokens needs more KV cache blocks than the cache has"
        (self.finished.__setitem__(rid, req) if req.error else self.waiting.append(req))
        return rid

    def _admit(self) -> list[Request]:
        m, new = self.cache.manager, []
        for req in list(self.waiting):
            need = len(req.prompt) + req.params.max_new_tokens
            if m.can_hold(req.id, need):
                m.reserve(req.id, need)
                self.waiting.remove(req)
                new.append(req)
        return new

    def step(self) -> None:
        """One forward: prefill the admitted requests, decode one token of the others."""
        new = self._admit()
        batch_reqs = new + self.running
        if not batch_reqs:
            if self.waiting:
                raise FlashgenError("the KV cache cannot hold any waiting request")
            return
        tokens, positions, slots, lens, ctx = [], [], [], [], []
        bs = self.cache.manager.block_size
        for req in batch_reqs:
            fresh = req in new
            toks = req.tokens if fresh else req.tokens[-1:]
            start = 0 if fresh else len(req.tokens) - 1
            table = self.cache.manager.tables[req.id]
            pos = list(range(start, start + len(toks)))
            tokens += toks
            positions += pos
            slots += [table[p // bs] * bs + p % bs for p in pos]
            lens.append(len(toks))
            ctx.append(start + len(toks))
        seqs = [r.id for r in batch_reqs]
        if self.graphs is not None and len(tokens) == len(seqs) and self.graphs.fits(len(seqs)):
            logits = self.graphs.run(seqs, tokens, positions, slots)
        else:
            dev = self.model.device
            batch = Batch(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                          torch.tensor(slots, device=dev), seqs, lens, ctx)
            logits = self.model.forward(batch, self.cache)
        greedy = logits.argmax(-1).tolist()  # every row's, in one device-to-host copy
        for req, row, top in zip(batch_reqs, logits, greedy):
            req.output.append(top if req.params.temperature <= 0 else sample(row, req.params, req.generator))
        self.running = []
        for req in batch_reqs:
            if req.done:
                self.cache.manager.release(req.id)
                self.finished[req.id] = req
            else:
                self.running.append(req)

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams()) -> list[Request]:
        ids = [self.add(p, params) for p in prompts]
        while self.waiting or self.running:
            self.step()
        return [self.finished[i] for i in ids]
