"""A migrated request's output so far, replayed: the state a continuation starts from.

When the router moves a stream to another engine, the new engine gets the same request
plus the output tokens the client already has (`SamplingParams.resume_token_ids`). It
appends them as if it had sampled them, through the same stop rules (eos, stop tokens
and strings, max_tokens; min_tokens counts them), so its sequence is in the state the
first engine's was when it sent them; the grammar matcher replays them too
(`structured.matchers`). Their KV is recomputed as after a preemption (a prefix-cache hit
where the engine holds it), and the deltas start after them.
"""

from __future__ import annotations

from kvpilot.engine.core.output_processor import OutputProcessor
from kvpilot.engine.core.request import Sequence


def replay_resumed(seq: Sequence, token_ids: list[int], outputs: OutputProcessor) -> None:
    """Appends `token_ids` to `seq`'s output as already sent (a finish they reach counts as
    sent too); raises ValueError naming the field when the output ended before the last."""
    for i, token in enumerate(token_ids):
        if seq.finish_reason is not None:
            raise ValueError(
                f"resume_token_ids has {len(token_ids)} tokens, but the output ended after "
                f"{i} ({seq.finish_reason}): send only the tokens up to its end")
        outputs.append_token(seq, token)
    seq.num_sent_tokens = len(token_ids)
    seq.finish_sent = seq.finish_reason is not None
