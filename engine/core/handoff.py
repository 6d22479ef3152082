"""The KV hand-off seam for disaggregated serving: export a prefill's blocks, import them.

Prefill side: `add_request(..., hold_blocks=True)` with `max_tokens=1`; once it
finishes, `export_blocks` gives its block ids and full-block hashes while the
blocks stay allocated; the transfer copies `runner.kv_caches[layer][:, block_ids]`
and then calls `release`. Decode side: `import_prefill` allocates blocks for the
prompt, marks it computed and appends the first token; the caller writes the K/V
into the returned block ids before the next `step()`, which decodes from there.
"""

from __future__ import annotations

import time

from kvpilot.engine.block_hash import hash_prompt_blocks
from kvpilot.engine.core.kv_cache_manager import cdiv
from kvpilot.engine.core.request import Request, SequenceStatus
from kvpilot.engine.detokenizer import init_offsets
from kvpilot.engine.sampling_params import SamplingParams


def export_blocks(engine, request_id: str) -> tuple[list[int], list[int]]:
    """Gives (block ids, full-block hashes) of a finished request held with hold_blocks=True."""
    seq = engine.held.get(request_id)
    if seq is None:
        raise KeyError(f"request_id={request_id!r} holds no blocks: add it with "
                       "hold_blocks=True and wait until it finishes")
    computed = seq.token_ids[:seq.num_computed_tokens]
    return engine.kv.block_ids(seq), hash_prompt_blocks(computed, engine.kv.block_size)


def release(engine, request_id: str) -> None:
    """Frees the blocks a held request kept for its export."""
    seq = engine.held.pop(request_id, None)
    if seq is not None:
        engine.kv.free(seq)


def import_prefill(engine, request_id: str, prompt_token_ids: list[int], first_token: int,
                   params: SamplingParams, arrival_time: float | None = None
                   ) -> list[int] | None:
    """Adds a request whose prompt K/V arrive from elsewhere; gives the block ids to fill.

    Gives None, adding nothing, when the pool has too few free blocks now (retry
    later). The request continues from `first_token` (sampled by the prefill side).
    """
    if request_id in engine.requests:
        raise ValueError(f"request_id={request_id!r} is already running: use a unique id")
    request = Request(request_id, None, list(prompt_token_ids), params,
                      time.monotonic() if arrival_time is None else arrival_time)
    reason = engine.scheduler.never_fits(request)
    if reason is not None:
        raise ValueError(reason)
    seq = request.seqs[0]
    num_tokens = len(prompt_token_ids)
    if cdiv(num_tokens + 1, engine.kv.block_size) > engine.kv.pool.num_free_blocks:
        return None
    init_offsets(seq)
    engine._seed(seq)
    engine.kv.allocate_slots(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    seq.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(seq)
    engine.requests[request_id] = request
    now = time.monotonic()
    request.metrics.first_scheduled_time = now
    block_ids = engine.kv.block_ids(seq)
    engine._append(seq, first_token, None, None, now)
    if request.finished:  # the first token was the whole output: nothing to decode here
        engine.requests.pop(request_id)
        request.metrics.finished_time = now
        engine._pending.append(engine.outputs.build(request))
        return block_ids
    engine.kv.cache_full_blocks(seq)  # the caller fills them before the next step
    return block_ids
