"""N-gram prompt lookup (vLLM's `ngram` method): drafts copied from the sequence's own context.

The last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) are
searched for earlier in the prompt and output; the tokens that followed the most
recent earlier match are the draft. No model runs, so the draft's distribution
is a point mass on each proposed token (the rejection sampler's `draft_probs=None`).
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], num_tokens: int, lookup_min: int, lookup_max: int
                  ) -> list[int]:
    """Gives up to `num_tokens` draft tokens continuing `token_ids`, or [] when no n-gram of
    length in [lookup_min, lookup_max] ending the context occurred before."""
    total = len(token_ids)
    if num_tokens <= 0 or total < lookup_min + 1:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, total - 1), lookup_min - 1, -1):
        suffix = ids[total - n:]
        # windows starting at 0 .. total - n - 1: every earlier occurrence, the suffix excluded
        windows = np.lib.stride_tricks.sliding_window_view(ids[:total - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + num_tokens].tolist()
    return []
