"""Prompts to send: random-length random-word prompts, or prompts sharing a few prefixes.

Prompts are made of words drawn from a fixed list, so the load generator needs
no tokenizer (and no torch); the true token counts come back in each
response's `usage`. With byte-level BPE tokenizers one such word is about one
to two tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "it", "an", "were", "are", "which", "this", "be", "or", "has", "had", "first", "one", "their", "its", "new", "after", "who", "they", "two", "her", "she", "been", "other", "when", "there", "all", "during", "into", "school", "time", "may", "years", "more", "most", "only", "over", "city", "some", "world", "would", "where", "later", "up", "such", "used", "many", "can", "state", "about", "national", "out", "known", "university", "united", "then", "made", "river", "north", "south", "east", "west", "light", "water", "stone", "paper", "music", "garden", "window", "market", "bridge", "signal", "engine", "cache", "block", "token", "prefix", "queue", "batch", "model", "kernel", "tensor", "router", "replica"]


@dataclass(frozen=True)
class SampleRequest:
    """One request of a benchmark: its prompt and how many tokens to ask for."""

    prompt: str
    prompt_words: int
    output_len: int


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    # Uniform in [mean * (1 - r), mean * (1 + r)], as vLLM's random dataset does.
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return rng.randint(low, high)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int) -> list[SampleRequest]:
    """Gives `num_prompts` requests of about `input_len` words and `output_len` tokens."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"random_range_ratio={range_ratio} is invalid: must be in [0, 1)")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in = _lengths(rng, input_len, range_ratio)
        out.append(SampleRequest(_words(rng, n_in), n_in,
                                 _lengths(rng, output_len, range_ratio)))
    return out


def shared_prefix_dataset(num_prompts: int, num_prefixes: int, prefix_len: int,
                          input_len: int, output_len: int, range_ratio: float,
                          seed: int) -> list[SampleRequest]:
    """Gives requests whose prompts start with one of `num_prefixes` shared prefixes.

    Request i uses prefix i mod num_prefixes followed by its own random suffix of
    about `input_len` words, so a prefix-caching server reuses the prefix's blocks.
    """
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes={num_prefixes} is invalid: must be at least 1")
    rng = random.Random(seed)
    prefixes = [_words(rng, prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        n_in = _lengths(rng, input_len, range_ratio)
        prompt = f"{prefixes[i % num_prefixes]} {_words(rng, n_in)}".strip()
        out.append(SampleRequest(prompt, prefix_len + n_in,
                                 _lengths(rng, output_len, range_ratio)))
    return out
