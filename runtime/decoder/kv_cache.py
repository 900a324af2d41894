"""Paged KV cache and its block manager.

Per layer, k and v live in [num_blocks, block_size, Hkv, D] tensors (the layout of the paged attention
ops); a sequence owns a list of blocks, its block table, and grows one block at a time. Blocks of
finished sequences return to the free list at once, so requests can join between steps. A manager may
keep one block out of circulation, the pad block, past its `num_blocks`: the padding rows of a CUDA-graph
decode step write their key and value there, so they never touch a real sequence's blocks.
"""
from __future__ import annotations

import torch

from flashgen.errors import FlashgenError


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, pad_block: bool = False):
        self.block_size = block_size
        self.pad: int | None = num_blocks if pad_block else None  # the block after the others, never handed out
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_hold(self, seq: int, tokens: int) -> bool:
        have = len(self.tables.get(seq, []))
        return self.blocks_for(tokens) - have <= len(self.free)

    def reserve(self, seq: int, tokens: int) -> list[int]:
        """Grow `seq`'s table to hold `tokens` tokens; returns the table."""
        table = self.tables.setdefault(seq, [])
        need = self.blocks_for(tokens) - len(table)
        if need > len(self.free):
            raise FlashgenError(f"the KV cache has {len(self.free)} free blocks, sequence {seq} needs {need}")
        table.extend(self.free.pop() for _ in range(max(0, need)))
        return table

    def release(self, seq: int) -> None:
        self.free.extend(reversed(self.tables.pop(seq, [])))

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
