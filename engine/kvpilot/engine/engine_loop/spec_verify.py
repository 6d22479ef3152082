"""Booking a speculative step's verify rows: grammar masks on the draft positions, then the
emitted tokens of each verified sequence (the pending token and its accepted drafts)."""

from __future__ import annotations

import time

import torch

from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request
from kvpilot.engine.engine_loop.beams import AppendToken
from kvpilot.engine.spec_decode.spec_decoder import VerifyItem
from kvpilot.engine.structured.bitmask import apply_token_bitmask
from kvpilot.engine.structured.matchers import GrammarMatchers
from kvpilot.engine.worker.device import to_device


def mask_verify_rows(items: list[VerifyItem], logits: torch.Tensor,
                     grammars: GrammarMatchers) -> torch.Tensor:
    """Gives `logits` with each constrained verify row masked by its grammar state (the
    rejection sampler then keeps the constrained distribution, and greedy picks within
    the grammar)."""
    rows, masks = [], []
    for item in items:
        mask = grammars.draft_bitmask(item.seq, item.drafts.token_ids)
        if mask is not None:
            rows.extend(range(item.row, item.row + mask.shape[0]))
            masks.append(mask)
    if not rows:
        return logits
    index = to_device(rows, logits.device, torch.long)
    masked = apply_token_bitmask(logits.index_select(0, index),
                                 torch.cat(masks).to(logits.device))
    return logits.index_copy(0, index, masked.to(logits.dtype))


def apply_verified(items: list[VerifyItem], emitted: list[list[int]], kv: KVCacheManager,
                   grammars: GrammarMatchers | None, append_token: AppendToken
                   ) -> list[Request]:
    """Books verified drafts: the pending token and the accepted drafts become computed,
    the emitted tokens are appended (stop checks per token), rejected slots are freed;
    gives the requests that got tokens."""
    now = time.monotonic()
    touched: dict[str, Request] = {}
    for item, tokens in zip(items, emitted, strict=True):
        seq = item.seq
        touched[seq.request.request_id] = seq.request
        seq.num_computed_tokens += len(tokens)  # the pending token + the accepted drafts
        for token in tokens:
            if grammars is not None:
                grammars.accept(seq, token)
            append_token(seq, token, None, None, now)
            if seq.finish_reason is not None:
                break
        if not seq.finished:
            kv.free_tail(seq, seq.num_computed_tokens)
            kv.cache_full_blocks(seq)
    return list(touched.values())
