"""Batched generation: requests join and leave between steps; each step runs one forward over the
prefills of newly admitted requests and one decode token of every running one.

A request is admitted when the cache can hold its prompt plus its remaining new tokens; one that could
never fit is refused with a clear error, and the others go on unharmed. Sampling is greedy (temperature
0) or by temperature, top-k, top-p and min-p, with a per-request seed, either after a repetition
penalty, all as transformers applies them (`distribution`); a request ends at a stop token (by default
the model's EOS ids) or after max_new_tokens. On a GPU, steps in which every sequence brings one token
replay CUDA graphs (runtime/decoder/decode_graphs.py); steps with prefills run eagerly.

When every request of a replayed step is plain greedy (no repetition penalty), the engine does not wait
for its tokens: the step stays pending, and the next `step` call first replays the step after it (same
sequences, the tokens the graph chose, still on the device) and only then reads the pending step's
tokens, so the GPU never idles while the host does its bookkeeping. A step is chained only while no
request waits to join and none reaches max_new_tokens; a request that meets a stop token in a pending
step has one more token computed, and discarded (its cache blocks are still its own when that step
runs: the stream orders every later use).

Requests are admitted first come, first served: a waiting request that does not fit yet holds back those
that came after it, so a long one is admitted once the running requests before it have finished, not
starved by a stream of short ones that each fit.

Prefix caching (`prefix_cache`, on by default; runtime/decoder/kv_cache.py): after each step the full
blocks of every request whose keys and values are all computed are published, and a finished request's
stay in the cache. A request admitted later whose prompt starts with published blocks takes them and
prefills only the rest, its queries attending to the cached part as a chunked prefill's do
(`cached_tokens` counts the tokens it did not compute). At least the prompt's last token is computed,
for its logits. A request is held back for one step (with those behind it, first come first served)
when the next block of its prompt is one that a request admitted in the same step is computing: it
shares that block from the next step on, instead of computing it again beside it; a block is never
shared before it is written. Idle cached blocks count as available at admission and are evicted least
recently used first when no block is free.

The engine never loses a request; each one ends in `finished` (taken out by `pop_finished`, or by
`generate` for its own), with `error` set if it failed:
- `add` raises FlashgenError, in one line naming the field and its value, for a malformed request: a
  sampling parameter of the wrong type or outside its range, an empty prompt, a token id that is no
  integer or lies outside the model's vocabulary. That is the caller's bug, and no engine could serve
  it. A well-formed request that this engine cannot serve (longer than the model's context or than the
  whole KV cache) is accepted and finished at once with its reason, so that it alone is refused.
- In a step, an error that belongs to one request fails that request alone: its sampling raised, or
  its row of logits holds a NaN or +inf ("the logits at step N are NaN or inf", step 0 its prefill),
  which would otherwise be read as some token (argmax of NaNs is 0). One that belongs to none (the
  forward or a replay raised) fails every request of the step with its reason and frees their blocks;
  `step` then returns normally, so the engine keeps serving the waiting requests and a serving loop
  needs no handler. Token ids are checked at `add` because an out-of-vocabulary id on a GPU is a
  device-side assert, which no engine survives.
- `abort` finishes a waiting or running request with error "aborted".

Split over tensor-parallel ranks (`tp`; runtime/decoder/tensor_parallel.py), every rank runs this engine on the
same requests, so admission, block tables and chaining agree without a message. Plain greedy tokens
need none either: every rank's logits are the same all-gathered bytes, so its argmax is rank 0's (and a
chained step's replay is not held up). A step that samples (or penalizes) takes rank 0's tokens,
broadcast. A step
that fails on one rank cannot go on on the others, so under `tp` it raises (FlashgenError, one line)
after failing its requests, and the group stops.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch

from flashgen.errors import FlashgenError, one_line
from flashgen.runtime.decoder.decode_graphs import NON_FINITE, DecodeGraphs, greedy
from flashgen.runtime.decoder.kv_cache import PagedKVCache, block_keys
from flashgen.runtime.decoder.model import Batch, Decoder
from flashgen.runtime.decoder.sampling import SamplingParams, check_request, sample
from flashgen.runtime.decoder.tensor_parallel import agree


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    error: str = ""
    generator: torch.Generator | None = None
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache, not computed

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return bool(self.error) or len(self.output) >= self.params.max_new_tokens or \
            (bool(self.output) and self.output[-1] in self.params.stop_tokens)


@dataclass
class _Pending:
    """A replayed decode step whose tokens are on their way to the host: valid once `ready` has run
    (None: already there)."""
    reqs: list[Request]
    tokens: torch.Tensor  # [len(reqs)] int64 (NON_FINITE marks kept), pinned for a copy from a GPU
    ready: torch.cuda.Event | None


class Engine:
    def __init__(self, model: Decoder, num_blocks: int = 256, block_size: int = 16, cuda_graphs: bool = True,
                 chain: bool = True, tp: int | None = None, prefix_cache: bool = True):
        """`num_blocks` cache blocks hold the requests' keys and values; one more, the pad block, takes the
        graphs' padding rows. Every engine keeps it, with or without graphs, so that a step's workloads
        (the cache's size, the block tables' width) and thus its kernels and results are the same both
        ways. `cuda_graphs` applies when the model runs its generated attention on a GPU and its steps are
        capturable (`Decoder.capturable`). `chain`
        lets greedy graph steps run ahead of the host (module docstring); without it every step waits for
        its tokens. `tp`, when given, is the tensor-parallel degree the model must have been built for (a
        `ShardedDecoder` in each rank: runtime/decoder/tensor_parallel.py). `prefix_cache` shares the cached
        blocks of prompts' common prefixes (module docstring)."""
        if tp is not None and tp != model.tp:
            raise FlashgenError(f"Engine(tp={tp}) needs a decoder split over {tp} ranks (runtime/decoder/tensor_parallel.py: "
                                f"ShardedDecoder, in each rank); this one is split over {model.tp}")
        c = model.c
        self.model = model
        graphs = cuda_graphs and model.uses_tables and model.capturable
        self.cache = PagedKVCache(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, model.dtype,
                                  model.device, pad_block=True)
        self.graphs = DecodeGraphs(model, self.cache) if graphs else None
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}  # until `pop_finished` (or `generate`) takes them
        self.pending: _Pending | None = None
        self.chain = chain
        self.prefix_cache = prefix_cache
        self._next_id = 0

    def add(self, prompt: list[int], params: SamplingParams = SamplingParams()) -> int:
        """Queue a request; its id. A malformed one raises FlashgenError; one this engine cannot serve is
        finished at once with its reason (module docstring)."""
        check_request(prompt, params, self.model.c.vocab_size)
        if params.stop_tokens is None:
            params = replace(params, stop_tokens=self.model.c.eos_token_ids)
        rid, self._next_id = self._next_id, self._next_id + 1
        req = Request(rid, [int(t) for t in prompt], params, generator=torch.Generator().manual_seed(params.seed))
        c, m = self.model.c, self.cache.manager
        if len(prompt) + params.max_new_tokens > c.max_position_embeddings:
            req.error = (f"prompt of {len(prompt)} tokens + {params.max_new_tokens} new exceeds the model's context "
                         f"of {c.max_position_embeddings}")
        elif m.blocks_for(len(prompt) + params.max_new_tokens) > m.num_blocks:
            req.error = "prompt + max_new_tokens needs more KV cache blocks than the cache has"
        (self.finished.__setitem__(rid, req) if req.error else self.waiting.append(req))
        return rid

    def abort(self, request_id: int) -> bool:
        """Finish a waiting or running request with error "aborted", freeing its blocks; False when the
        engine holds no such unfinished request. One inside the pending step is only marked: it is
        retired when that step is read, at the next `step` (its replay may still use its blocks)."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                self._finish(req, "aborted")
                return True
        for req in self.running:
            if req.id == request_id:
                req.error = "aborted"
                if self.pending is None:  # (with a step pending, every running request is in it)
                    self.running.remove(req)
                    self._finish(req)
                return True
        return False

    def pop_finished(self) -> list[Request]:
        """The requests finished since the last call, in the order they finished; the engine keeps none,
        so a long-running one does not accumulate every result."""
        done, self.finished = list(self.finished.values()), {}
        return done

    def _finish(self, req: Request, error: str = "") -> None:
        """Release `req`'s blocks and hand it over in `finished`, keeping the first error it met."""
        req.error = req.error or error
        self.cache.manager.release(req.id)
        self.finished[req.id] = req

    def _admit(self) -> list[Request]:
        """Admit waiting requests in arrival order while the cache can hold them: one that does not fit
        holds back those behind it, so a long request is not starved by a stream of short ones. Each
        takes the cached blocks its prompt (all but its last token) starts with; one whose next block a
        request admitted here will compute waits a step to share it (module docstring)."""
        m, new, computing = self.cache.manager, [], set()
        while self.waiting:
            req = self.waiting[0]
            keys = block_keys(req.prompt[:-1], m.block_size) if self.prefix_cache else []
            prefix = m.cached_prefix(keys)
            if len(prefix) < len(keys) and keys[len(prefix)] in computing:
                break
            need = len(req.prompt) + req.params.max_new_tokens
            if not m.can_hold(req.id, need, prefix):
                break
            m.reserve(req.id, need, prefix, keys)
            req.cached_tokens = len(prefix) * m.block_size
            computing.update(keys[len(prefix):])
            new.append(self.waiting.pop(0))
        return new

    def step(self) -> None:
        """One forward: prefill the admitted requests, decode one token of the others. With a step
        pending, the step after it is replayed when it can be, and the pending one is read."""
        if self.pending is not None:
            with self._failing_running():
                self._read_pending()
            return
        new = self._admit()
        self.running = new + self.running
        if self.running:
            with self._failing_running():
                self._forward(len(new))
        elif self.waiting:
            raise FlashgenError("the KV cache cannot hold any waiting request")

    @contextmanager
    def _failing_running(self) -> Iterator[None]:
        """An exception no single request owns (a forward, a replay, a copy) fails every running request
        with its reason and frees their blocks, and is not raised: the engine serves on (module
        docstring). An interrupt (KeyboardInterrupt, SystemExit) still propagates, the engine consistent."""
        try:
            yield
        except BaseException as e:
            for req in self.running:
                self._finish(req, f"step failed: {one_line(e)}")
            self.running, self.pending = [], None
            if not isinstance(e, Exception):
                raise
            if self.model.tp > 1:  # the other ranks cannot step without this one: the group stops
                raise e if isinstance(e, FlashgenError) else \
                    FlashgenError(f"rank {self.model.rank}: step failed: {one_line(e)}") from e

    def _read_pending(self) -> None:
        """Replay the step after the pending one when it can be, then read and record the pending one."""
        pending, self.pending = self.pending, self._chain(self.pending)
        if pending.ready is not None:
            pending.ready.synchronize()
        self._record(pending.reqs, pending.tokens.tolist(), None)

    def _forward(self, fresh: int) -> None:
        """Prefill the first `fresh` running requests (just admitted; past their cached prefix) and decode
        one token of the others."""
        batch_reqs = self.running
        tokens, positions, slots, lens, ctx = [], [], [], [], []
        bs = self.cache.manager.block_size
        for i, req in enumerate(batch_reqs):
            start = req.cached_tokens if i < fresh else len(req.tokens) - 1
            toks = req.tokens[start:]
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
            if self.chain and all(r.params.plain_greedy for r in batch_reqs):
                self.pending = self._pending(batch_reqs)
                return
            chosen = self.graphs.chosen(len(seqs))
        else:
            dev = self.model.device
            batch = Batch(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                          torch.tensor(slots, device=dev), seqs, lens, ctx)
            logits = self.model.forward(batch, self.cache)
            chosen = greedy(logits)
        self._record(batch_reqs, chosen.tolist(), logits)  # every row's, in one copy to the host

    def _pending(self, reqs: list[Request]) -> _Pending:
        """The step just replayed for `reqs`, its greedy tokens (NON_FINITE marks kept) copied to the host
        behind it."""
        chosen = self.graphs.chosen(len(reqs))
        gpu = chosen.is_cuda
        tokens = torch.empty(len(reqs), dtype=torch.int64, pin_memory=gpu)
        tokens.copy_(chosen, non_blocking=gpu)
        ready = torch.cuda.Event() if gpu else None
        if ready is not None:
            ready.record()
        return _Pending(reqs, tokens, ready)

    def _chain(self, p: _Pending) -> _Pending | None:
        """Replay the step after `p` (its requests' next tokens, as the graph chose them), unless the
        batch may change: a request waits, one of p's has stopped, or one reaches max_new_tokens with
        p's token."""
        if self.waiting or any(r.done or len(r.output) + 2 > r.params.max_new_tokens for r in p.reqs):
            return None
        bs = self.cache.manager.block_size
        positions = [len(r.tokens) for r in p.reqs]  # p's tokens are not appended yet
        slots = [self.cache.manager.tables[r.id][q // bs] * bs + q % bs for r, q in zip(p.reqs, positions)]
        self.graphs.run([r.id for r in p.reqs], None, positions, slots)
        return self._pending(p.reqs)

    def _record(self, reqs: list[Request], chosen: list[int], logits: torch.Tensor | None) -> None:
        """Append each request's token (greedy, or sampled from its row of `logits`: a sampling error or
        a NON_FINITE mark in `chosen` fails that request alone), retire the finished. A request already
        done gets no token: one stopped in the step before this chained one (retired then) or aborted
        inside it (retired now). With prefix caching, each request served in the step publishes its
        blocks whose keys and values are now all computed: every token's but the one just chosen."""
        running = {r.id for r in self.running}
        sampled = any(not r.done and not r.params.plain_greedy for r in reqs)
        picks = self._picks(reqs, chosen, logits) if self.model.rank == 0 or not sampled else [None] * len(reqs)
        if self.model.tp > 1 and sampled:  # (greedy tokens need no message: module docstring)
            picks = agree(picks, self.model)
        for req, pick in zip(reqs, picks):
            if isinstance(pick, str):
                req.error = pick
            elif pick is not None:
                req.output.append(pick)
                if self.prefix_cache and req.id in running:
                    self.cache.manager.publish(req.id, req.tokens, len(req.tokens) - 1)
        self.running = [r for r in reqs if not r.done]
        for req in reqs:
            if req.done and req.id in running:
                self._finish(req)

    @staticmethod
    def _picks(reqs: list[Request], chosen: list[int], logits: torch.Tensor | None) -> list[int | str | None]:
        """Each request's token (greedy, or sampled from its row of `logits`), why it has none (its
        logits are not finite, or its sampling failed), or None for a request already done."""
        picks: list[int | str | None] = []
        for i, (req, top) in enumerate(zip(reqs, chosen)):
            if req.done:
                picks.append(None)
            elif top == NON_FINITE:
                n = len(req.output)
                picks.append(f"the logits at step {n} (new token {n + 1}) are NaN or inf")
            elif req.params.plain_greedy:
                picks.append(top)
            else:
                try:
                    picks.append(sample(logits[i], req.params, req.generator, req.tokens))
                except Exception as e:
                    picks.append(f"sampling failed: {one_line(e)}")
        return picks

    def generate(self, prompts: list[list[int]], params: SamplingParams = SamplingParams()) -> list[Request]:
        """Run `prompts` to the end; their requests, taken out of `finished`. Every prompt is checked
        before any is queued, so a malformed one raises with none of them left in the engine."""
        for p in prompts:
            check_request(p, params, self.model.c.vocab_size)
        ids = [self.add(p, params) for p in prompts]
        while self.waiting or self.running or self.pending:
            self.step()
        return [self.finished.pop(i) for i in ids]
