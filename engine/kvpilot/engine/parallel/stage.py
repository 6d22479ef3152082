"""A rank's pipeline stage: which layers it holds, and the activations stages pass on.

`SINGLE_STAGE` is the whole model on one stage (no pipeline parallelism): it embeds,
runs every layer and computes the logits, as the engine did before stages existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.engine.contracts.pipeline import stage_layers


@dataclass(frozen=True)
class PipelineStage:
    """Stage `rank` of `size`; it holds decoder layers `layers` (global indices)."""

    rank: int
    size: int
    layers: range

    @classmethod
    def of(cls, num_layers: int, size: int, rank: int) -> PipelineStage:
        """Gives stage `rank` of `size` over a model of `num_layers` (contracts/pipeline.py)."""
        return cls(rank, size, stage_layers(num_layers, size, rank))

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        """Gives the single stage that holds the whole model."""
        return cls(0, 1, range(num_layers))

    @property
    def is_first(self) -> bool:
        """Gives whether this stage embeds the tokens."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """Gives whether this stage runs the final norm and the LM head."""
        return self.rank == self.size - 1


@dataclass
class Intermediate:
    """What one stage hands the next: the hidden states and the residual stream [T, hidden]
    (the residual not yet added in, as the decoder layers keep it)."""

    hidden: torch.Tensor
    residual: torch.Tensor
