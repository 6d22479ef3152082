"""What a draft proposer gives the spec step, the n-gram proposer, and the draws both share."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from kvpilot.engine.contracts.speculative import SpeculativeConfig
from kvpilot.engine.core.request import Sequence
from kvpilot.engine.spec_decode.ngram_proposer import propose_ngram


@dataclass
class Drafts:
    """One sequence's draft tokens and, for a draft model, its distribution at each."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab]; None: point mass (n-gram)


class Proposer(Protocol):
    """Proposes up to k draft tokens for each decode of a step."""

    def propose(self, items: list[tuple[Sequence, int]]) -> list[Drafts]:
        """Gives drafts per (sequence, most drafts) item, in order (possibly fewer, or none)."""
        ...

    def forget(self, seq: Sequence) -> None:
        """Drops what the proposer kept about `seq` (preempted: its blocks are gone)."""
        ...


class NgramProposer:
    """Proposes the tokens that followed the context's suffix where it occurred before."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lookup_min = config.prompt_lookup_min
        self.lookup_max = config.prompt_lookup_max

    def propose(self, items: list[tuple[Sequence, int]]) -> list[Drafts]:
        """Gives each sequence's n-gram continuation (no model runs)."""
        return [Drafts(propose_ngram(seq.token_ids, k, self.lookup_min, self.lookup_max))
                for seq, k in items]

    def forget(self, seq: Sequence) -> None:
        """Keeps nothing per sequence."""


def uniform_rows(generators: Seq[torch.Generator | None], width: int,
                 device: torch.device) -> torch.Tensor:
    """Gives [len(generators), width] uniform draws; a seeded row draws from its generator."""
    out = torch.rand(len(generators), width, device=device)
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i] = torch.rand(width, device=device, generator=gen)
    return out


def exponential_rows(generators: Seq[torch.Generator | None], width: int,
                     device: torch.device) -> torch.Tensor:
    """Gives [len(generators), width] exponential(1) draws (the sampler's race noise)."""
    out = torch.empty(len(generators), width, device=device).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i].exponential_(generator=gen)
    return out
