"""Builds paged KV caches and flat-batch `AttentionMetadata` for tests, with shuffled blocks.

    batch = PagedBatch.build(seq_lens=[7, 20], query_lens=[7, 5], block_size=4, ...)

`seq_lens[i]` counts sequence i's tokens after this step; its last `query_lens[i]` are
this step's query rows. Blocks are handed out in a seeded random order, so any
backend that ignores the block table reads the wrong data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.engine.attention.metadata import AttentionMetadata


@dataclass
class BlockAllocation:
    """A fixed, shuffled assignment of cache blocks to sequences."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 padded
    block_size: int
    num_blocks: int

    @classmethod
    def shuffled(cls, max_seq_lens: list[int], block_size: int, seed: int = 0,
                 spare_blocks: int = 3) -> BlockAllocation:
        """Gives tables covering `max_seq_lens` tokens per sequence from a shuffled pool."""
        needed = [-(-n // block_size) for n in max_seq_lens]
        num_blocks = sum(needed) + spare_blocks
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        tables = torch.full((len(needed), max(needed)), -1, dtype=torch.int32)
        used = 0
        for i, count in enumerate(needed):
            tables[i, :count] = order[used:used + count].int()
            used += count
        return cls(tables, block_size, num_blocks)

    def new_kv_caches(self, num_layers: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
        """Gives one NaN-filled cache per layer, so a read of an unwritten slot shows up."""
        shape = (2, self.num_blocks, self.block_size, num_kv_heads, head_dim)
        return [torch.full(shape, float("nan"), dtype=dtype) for _ in range(num_layers)]

    def step(self, seq_lens: list[int], query_lens: list[int],
             device: torch.device | str = "cpu") -> AttentionMetadata:
        """Gives the metadata of one step on `device`: sequence i adds positions
        [seq_lens[i] - query_lens[i], seq_lens[i]); the leading query_len-1 rows count as
        decodes, as the model runner orders them."""
        slots, starts = [], [0]
        for i, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
            for pos in range(seq_len - q_len, seq_len):
                block = int(self.block_tables[i, pos // self.block_size])
                slots.append(block * self.block_size + pos % self.block_size)
            starts.append(starts[-1] + q_len)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=self.block_tables.to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decode_tokens=next(
                (i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )


def flat_positions(seq_lens: list[int], query_lens: list[int]) -> torch.Tensor:
    """Gives the positions [T] of a step's query rows, sequences laid end to end."""
    return torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, query_lens, strict=True)])


def step_logits(model, prompts: list[torch.Tensor], alloc: BlockAllocation,
                steps: list[list[int]], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Gives each prompt's logits (on the CPU) for every position it fed, concatenated over
    `steps`: step s feeds the next `steps[s][i]` tokens of prompt i, all prompts as one flat
    batch over caches in the model's dtype; a prompt adding nothing sits the step out, as
    the scheduler would do."""
    cfg = model.config
    caches = [c.to(device) for c in alloc.new_kv_caches(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)]
    done = [0] * len(prompts)
    pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
    for added in steps:
        active = [i for i, n in enumerate(added) if n > 0]
        seq_lens = [done[i] + added[i] for i in active]
        qlens = [added[i] for i in active]
        sub = BlockAllocation(alloc.block_tables[active], alloc.block_size, alloc.num_blocks)
        meta = sub.step(seq_lens, qlens, device)
        ids = torch.cat([prompts[i][done[i]:done[i] + added[i]] for i in active]).to(device)
        hidden = model(ids, flat_positions(seq_lens, qlens).to(device), caches, meta)
        for i, out in zip(active, model.compute_logits(hidden).split(qlens), strict=True):
            pieces[i].append(out.cpu())
            done[i] += added[i]
    return [torch.cat(p) for p in pieces]
