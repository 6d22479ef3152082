"""Seeded sampling keyed by position: a seeded request's draw for its k-th output token
depends only on (seed, completion index, k), never on how many draws came before.

A request that moves to another engine mid-stream (the router's migration) resumes at
output position k on a fresh generator; keying each draw by its position makes that
engine draw what the first one would have, so a seeded stream is token-for-token the
same as an undisturbed run. Reseeding costs one generator seed per seeded row per step
(microseconds; the fused sampler draws no seeded rows anyway).
"""

from __future__ import annotations

import torch

from kvpilot.engine.core.request import Sequence

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """Gives splitmix64's output for state `x` (a well-mixed 64-bit function)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_seed(seed: int, index: int, position: int) -> int:
    """Gives the generator seed of completion `index`'s output token `position` (63 bits)."""
    mixed = _splitmix64(_splitmix64(_splitmix64(seed & _MASK) ^ index) ^ position)
    return mixed >> 1


def seeded_generator(seq: Sequence) -> torch.Generator | None:
    """Gives `seq`'s generator seeded for the output token it samples next (its token ids
    hold the prompt, the output so far and, under async scheduling, the placeholder of the
    token in flight: the next one goes at their end), None for an unseeded request."""
    generator, seed = seq.generator, seq.request.params.seed
    if generator is None or seed is None:
        return None
    return generator.manual_seed(position_seed(seed, seq.index, seq.num_output_tokens))
