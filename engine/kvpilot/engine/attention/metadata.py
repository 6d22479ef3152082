"""The flat batch the model runner hands to every attention layer.

One step's batch is T tokens from B sequences laid end to end: sequence i owns
query rows ``query_start_loc[i]:query_start_loc[i+1]``; those rows are its last
``query_len`` positions, and the rest of its ``seq_len`` tokens already sit in
the paged KV cache. Each layer's cache is one tensor
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V); token
position ``p`` of sequence ``i`` lives in block ``block_tables[i, p // block_size]``
at offset ``p % block_size``, and ``slot_mapping[t] = block * block_size + offset``
tells where query row ``t``'s new K/V go (``-1``: do not write).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Block tables and lengths of one step; tensors live on the model's device."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens per sequence
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, -1 padded
    max_query_len: int
    max_seq_len: int
    num_decode_tokens: int = 0  # sequences with query_len 1 come first when > 0
    # [num_decode_tokens] int64, the decode rows longest context first: the order the decode
    # kernel launches them in (None: row order)
    decode_order: torch.Tensor | None = None
    # host copies, so backends avoid device syncs when building loops
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # how many sequences after the decode rows lead up to the last one with a cached prefix
    # (None: unknown, as if all): those after have none, and the backend hands them to the
    # prefill launcher as a batch of their own, which its no-prefix kernel takes
    # (worker/step_batch.py puts the count in the header)
    prefixed_prefills: int | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
