"""Tensor-parallel layers: row-parallel linear, vocab-parallel embedding and LM head.

Column-parallel layers need no class of their own: a `MergedLinear` built with this
rank's heads or rows (q|k|v, gate|up) is one, and its output stays sharded until the
row-parallel layer after it. Each factory gives today's plain torch layer on one rank,
so the single-rank model runs exactly what it ran before (no collective, no copy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from kvpilot.engine.models.layers import (
    Linear,
    RMSNorm,
    WeightLayout,
    WeightSlot,
    rows_source,
)
from kvpilot.engine.parallel.groups import TPGroup, shard_slice


class RowParallelLinear(Linear):
    """A linear layer holding a slice of the input columns: y = all_reduce(x_r W_r^T) + b.

    The bias is added once, after the sum, so it is not counted `size` times. With
    `reduce_output` off (set by `sum_in_next_norm`) the layer gives its partial sum and the
    norm after it all-reduces.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features // tp.size, out_features, bias=bias)
        self.tp = tp
        self.full_in_features = in_features
        self.reduce_output = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = self.matmul(input, self.weight)
        if not self.reduce_output:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def weight_layout(self, prefix: str) -> WeightLayout:
        """Gives this rank's columns of the checkpoint's weight; the bias whole."""
        cols = shard_slice(self.full_in_features, self.tp.rank, self.tp.size)
        layout = {f"{prefix}.weight": WeightSlot(
            f"{prefix}.weight", (self.out_features, self.full_in_features),
            source=rows_source(cols, self.full_in_features, dim=1))}
        if self.bias is not None:
            layout[f"{prefix}.bias"] = WeightSlot(f"{prefix}.bias", (self.out_features,))
        return layout


class VocabShard(nn.Module):
    """Rows of a [vocab, hidden] matrix: each rank holds a contiguous slice of the
    vocabulary, padded to a multiple of the group size."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        # padding rows stay zero: never looked up, and their logits are cut off
        self.weight: torch.Tensor = nn.Parameter(torch.zeros(self.rows_per_rank, hidden_size))

    def weight_layout(self, name: str, param: str) -> WeightLayout:
        """Gives where this rank's vocabulary rows of checkpoint tensor `name` land."""
        rows = self.vocab_end - self.vocab_start
        return {name: WeightSlot(param, (self.vocab_size, self.weight.shape[1]),
                                 index=(slice(0, rows),),
                                 source=(slice(self.vocab_start, self.vocab_end),))}


class VocabParallelEmbedding(VocabShard):
    """A token's row comes from the rank that holds it, zeros elsewhere, summed over ranks."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight).masked_fill_(~mine.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabShard):
    """The LM head over this rank's vocabulary slice; the logits are gathered to rank 0. Its
    matmul is a seam, as `Linear`'s."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.matmul: Callable[..., torch.Tensor] = F.linear

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gives logits [N, vocab] on rank 0 (this rank's [N, vocab / size] elsewhere)."""
        logits = self.tp.gather_first(self.matmul(hidden, self.weight))
        return logits[:, :self.vocab_size] if self.tp.is_first else logits


def sum_in_next_norm(linear: nn.Module, norm: RMSNorm) -> None:
    """Leaves the all-reduce of row-parallel `linear` to `norm`, the residual norm its output
    goes to next (where symmetric memory sums, adds and normalises in one kernel); a layer
    with a bias, or on one rank, keeps its own."""
    if isinstance(linear, RowParallelLinear) and linear.bias is None:
        linear.reduce_output = False
        norm.sum_over = linear.tp


def linear_layout(prefix: str, linear: nn.Linear) -> WeightLayout:
    """Gives the layout of a linear layer: this rank's columns, or the whole tensors."""
    if isinstance(linear, RowParallelLinear):
        return linear.weight_layout(prefix)
    layout = {f"{prefix}.weight": WeightSlot(f"{prefix}.weight", tuple(linear.weight.shape))}
    if linear.bias is not None:
        layout[f"{prefix}.bias"] = WeightSlot(f"{prefix}.bias", tuple(linear.bias.shape))
    return layout


def row_parallel_linear(in_features: int, out_features: int, bias: bool,
                        tp: TPGroup) -> Linear:
    """Gives a row-parallel linear layer, or a plain one on a single rank."""
    if tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def vocab_embedding(vocab_size: int, hidden_size: int,
                    tp: TPGroup) -> nn.Embedding | VocabParallelEmbedding:
    """Gives the token embedding: vocab-parallel, or a plain nn.Embedding on a single rank."""
    if tp.size == 1:
        return nn.Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head(vocab_size: int, hidden_size: int, tp: TPGroup) -> Linear | ParallelLMHead:
    """Gives the LM head: vocab-parallel with gathered logits, or a plain `Linear`."""
    if tp.size == 1:
        return Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(vocab_size, hidden_size, tp)
