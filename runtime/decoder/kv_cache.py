"""Paged KV cache and its block manager.

Per layer, k and v live in [num_blocks, block_size, Hkv, D] tensors (the layout of the paged attention
ops); a sequence owns a list of blocks, its block table, and grows one block at a time. A manager may
keep one block out of circulation, the pad block, past its `num_blocks`: the padding rows of a CUDA-graph
decode step write their key and value there, so they never touch a real sequence's blocks.

Prefix caching: a full block whose every token's key and value has been computed can be published
under its key, a hash of its tokens chained with the key of the block before it (`block_keys`), so
that the key names the whole prefix the block ends. A later sequence whose tokens start with published
blocks takes them into its table (`cached_prefix`, then `reserve`), each block counting the tables that
hold it; such a block is only ever read, since a sequence writes only past its cached prefix. When the
last table holding a published block lets it go, it stays in the cache, idle, in least-recently-used
order; a sequence needing a new block takes a free one first, then the least recently used idle one,
whose key is then forgotten. Blocks never published go back to the free list at once, so requests can
join between steps. Keys are SHA-256 digests: deterministic, so tensor-parallel ranks agree on every
table, and not forgeable, so one prompt cannot be made to read another's blocks.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

from flashgen.errors import FlashgenError


def block_keys(tokens: Sequence[int], block_size: int, keys: Sequence[bytes] = ()) -> list[bytes]:
    """The keys of every full block of `tokens`: `keys` (those of its first blocks, already known),
    extended. A block's key hashes its tokens with the key before it, so equal keys mean equal prefixes."""
    out = list(keys)
    for i in range(len(out), len(tokens) // block_size):
        chunk = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        out.append(hashlib.sha256((out[-1] if out else b"") + chunk).digest())
    return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, pad_block: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pad: int | None = num_blocks if pad_block else None  # the block after the others, never handed out
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}
        self.refs: dict[int, int] = {}  # each block some table holds: how many do
        # published blocks no table holds, least recently used first
        self.cached: OrderedDict[int, bytes] = OrderedDict()
        self.key_of: dict[int, bytes] = {}  # every published block's key, held or idle
        self.block_of: dict[bytes, int] = {}
        self.keys: dict[int, list[bytes]] = {}  # each sequence's known block keys (its first blocks')
        self.published: dict[int, int] = {}  # how many of its first blocks were offered for publishing

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def available(self) -> int:
        """Blocks a reservation can take: the free ones and the idle cached ones."""
        return len(self.free) + len(self.cached)

    def cached_prefix(self, keys: Sequence[bytes]) -> list[int]:
        """The published blocks of the longest run of `keys` from the first: a prefix a sequence can share."""
        out = []
        for key in keys:
            if (block := self.block_of.get(key)) is None:
                break
            out.append(block)
        return out

    def can_hold(self, seq: int, tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Whether `seq` can grow to `tokens` tokens, its table starting with the cached blocks `prefix`
        when it has none yet (idle cached blocks count as available, less those `prefix` takes)."""
        have = len(self.tables.get(seq, [])) + len(prefix)
        return self.blocks_for(tokens) - have <= self.available - sum(b in self.cached for b in prefix)

    def reserve(self, seq: int, tokens: int, prefix: Sequence[int] = (), keys: Sequence[bytes] = ()) -> list[int]:
        """Grow `seq`'s table to hold `tokens` tokens; returns the table. A new table may start with the
        cached blocks `prefix` (`cached_prefix` of `keys`, the keys of its first blocks, which publishing
        its later blocks extends)."""
        if prefix and (seq in self.tables or len(keys) < len(prefix)):
            raise FlashgenError(f"a cached prefix starts a new table, with its keys; sequence {seq} has "
                                f"{len(self.tables.get(seq, []))} blocks and {len(keys)} keys for {len(prefix)}")
        if not self.can_hold(seq, tokens, prefix):
            need = self.blocks_for(tokens) - len(self.tables.get(seq, [])) - len(prefix)
            raise FlashgenError(f"the KV cache has {self.available} available blocks, sequence {seq} needs {need}")
        table = self.tables.setdefault(seq, [])
        for block in prefix:
            self.cached.pop(block, None)
            self.refs[block] = self.refs.get(block, 0) + 1
            table.append(block)
        if keys:
            self.keys[seq] = list(keys)
        if prefix:
            self.published[seq] = len(prefix)
        table.extend(self._take() for _ in range(max(0, self.blocks_for(tokens) - len(table))))
        return table

    def _take(self) -> int:
        """A block for one table: a free one, else the least recently used idle cached one, unpublished."""
        if self.free:
            block = self.free.pop()
        else:
            block, key = self.cached.popitem(last=False)
            del self.key_of[block], self.block_of[key]
        self.refs[block] = 1
        return block

    def publish(self, seq: int, tokens: Sequence[int], written: int) -> None:
        """Publish `seq`'s full blocks among its first `written` tokens (`tokens`, its whole sequence),
        whose keys and values are all computed. A block whose key another block already has (both were
        computed at once) stays the sequence's own."""
        done, full = self.published.get(seq, 0), written // self.block_size
        if full <= done:
            return
        keys = self.keys[seq] = block_keys(tokens[:full * self.block_size], self.block_size, self.keys.get(seq, ()))
        table = self.tables[seq]
        for i in range(done, full):
            block, key = table[i], keys[i]
            if block not in self.key_of and key not in self.block_of:
                self.key_of[block], self.block_of[key] = key, block
        self.published[seq] = full

    def release(self, seq: int) -> None:
        """Let `seq`'s blocks go: each no other table holds is idle in the cache if published, else free.
        Its last blocks go first, so they are evicted before the prefix blocks later prompts share."""
        for block in reversed(self.tables.pop(seq, [])):
            self.refs[block] -= 1
            if self.refs[block] > 0:
                continue
            del self.refs[block]
            if block in self.key_of:
                self.cached[block] = self.key_of[block]
            else:
                self.free.append(block)
        self.keys.pop(seq, None)
        self.published.pop(seq, None)

    def padded_tables(self, seqs: list[int], width: int, rows: int | None = None) -> list[list[int]]:
        """The block tables of `seqs` as rows of `width` entries, the form the attention kernels read: the
        entries past a table are 0 (never read: they lie past its context). Rows past the sequences, up to
        `rows`, are padding rows, all in the pad block."""
        out = []
        for s in seqs:
            t = self.tables[s]
            if len(t) > width:
                raise FlashgenError(f"sequence {s} holds {len(t)} blocks, more than the table width {width}")
            out.append(t + [0] * (width - len(t)))
        pad = rows - len(seqs) if rows is not None else 0
        if pad > 0 and self.pad is None:
            raise FlashgenError("padding rows need a block manager with a pad block")
        return out + [[self.pad] * width for _ in range(pad)]


class PagedKVCache:
    def __init__(self, layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, pad_block: bool = False):
        shape = (num_blocks + int(pad_block), block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.manager = BlockManager(num_blocks, block_size, pad_block)

    def slot_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values as [slots, heads, head_dim], a slot being block * block_size +
        offset: what `rope_cache` writes new tokens into."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])
