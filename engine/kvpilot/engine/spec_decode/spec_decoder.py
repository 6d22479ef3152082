"""The engine's speculative mode: drafts into a scheduled step, verification of its logits.

The scheduler reserves k draft slots after each speculating decode's pending
token (`Scheduler._num_spec_tokens`), so a step's verify tokens are scheduled
like a small prefill chunk. Here the proposer fills them (`prepare`), shrinking
each entry to the drafts it really got and freeing the slots it left unused;
after the target's one forward over [pending token, drafts...] (`logits="all"`),
`verify` runs the rejection sampler over those rows (an all-greedy batch takes
the argmax comparison it reduces to). The engine then books the accepted tokens
(`engine_loop/spec_verify.py`): only verified tokens ever count as computed, so
the prefix cache never hashes a draft, and the rejected drafts' slots are freed.
Where decode graphs are captured, a step of decodes and short verifies replays a
graph with each verify entry as single-token rows (`engine.row_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.speculative import NGRAM, parse_speculative_config
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Sequence
from kvpilot.engine.core.scheduler import SchedulerOutput
from kvpilot.engine.spec_decode.draft_proposer import DraftModel, DraftModelProposer
from kvpilot.engine.spec_decode.proposers import (
    Drafts,
    NgramProposer,
    Proposer,
    exponential_rows,
    uniform_rows,
)
from kvpilot.engine.spec_decode.rejection_sampler import rejection_sample
from kvpilot.engine.worker.device import to_device
from kvpilot.engine.worker.sampler import processed_probs
from kvpilot.engine.worker.step_batch import BatchEntry


@dataclass
class SpecDecodeCounters:
    """vLLM's spec_decode counters: verifications with drafts, drafts, accepted, per position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


@dataclass
class VerifyItem:
    """A speculating sequence of a step: where its logits rows start, and its drafts."""

    seq: Sequence
    row: int
    drafts: Drafts


class SpecDecoder:
    """Proposes drafts for a step's speculating decodes and verifies them."""

    def __init__(self, proposer: Proposer, kv: KVCacheManager, num_speculative_tokens: int
                 ) -> None:
        self.proposer = proposer
        self.kv = kv
        self.counters = SpecDecodeCounters(
            num_accepted_tokens_per_pos=[0] * num_speculative_tokens)

    def prepare(self, plan: SchedulerOutput) -> dict[int, Drafts]:
        """Fills the reserved draft slots of `plan`; gives seq_id -> drafts of those that got any.

        Each speculating entry's count becomes 1 + its drafts, and `plan.scheduled`
        is re-sorted so single-token entries stay first (the attention layout).
        """
        for seq in plan.preempted:
            self.proposer.forget(seq)
        items = [(seq, num_new - 1) for seq, num_new in plan.scheduled
                 if num_new > 1 and seq.num_computed_tokens and seq.num_pending_tokens == 1]
        if not items:
            return {}
        proposed = self.proposer.propose(items)
        out: dict[int, Drafts] = {}
        for (seq, _), drafts in zip(items, proposed, strict=True):
            # the slots of drafts not proposed go back now; a step's rows follow the drafts
            self.kv.free_tail(seq, seq.num_computed_tokens + 1 + len(drafts.token_ids))
            if drafts.token_ids:
                out[seq.seq_id] = drafts
        plan.scheduled = [(seq, 1 + len(out[seq.seq_id].token_ids) if seq.seq_id in out
                           else (1 if num_new > 1 and seq.is_decode else num_new))
                          for seq, num_new in plan.scheduled]
        plan.scheduled.sort(key=lambda item: item[1] != 1)
        return out

    @staticmethod
    def fill(plan: SchedulerOutput, entries: list[BatchEntry], drafts: dict[int, Drafts]) -> None:
        """Appends each speculating entry's drafts and asks for all of its logits rows."""
        for (seq, _), entry in zip(plan.scheduled, entries, strict=True):
            found = drafts.get(seq.seq_id)
            if found is not None:
                entry.token_ids = [seq.token_ids[-1], *found.token_ids]
                entry.logits = "all"

    def verify(self, items: list[VerifyItem], logits: torch.Tensor) -> list[list[int]]:
        """Gives the tokens each item emits: its accepted drafts, then one target token."""
        dev = logits.device
        batch = len(items)
        k = max(len(item.drafts.token_ids) for item in items)
        vocab = logits.shape[1]
        # rows past an item's drafts repeat its last row; the sampler never reads them
        index = to_device([item.row + min(j, len(item.drafts.token_ids))
                           for item in items for j in range(k + 1)], dev)
        draft_ids = to_device([token for item in items for token in
                               (*item.drafts.token_ids, *[0] * (k - len(item.drafts.token_ids)))],
                              dev, torch.long).view(batch, k)
        num_draft = to_device([len(item.drafts.token_ids) for item in items], dev, torch.long)
        params = [item.seq.request.params for item in items]
        if all(p.greedy for p in params):
            tokens, num_accepted = _verify_greedy(
                logits.index_select(0, index).argmax(dim=1).view(batch, k + 1), draft_ids,
                num_draft)
        else:
            target = logits.index_select(0, index).float()
            probs = processed_probs(target, [p for p in params for _ in range(k + 1)])
            greedy = [p.greedy for p in params]
            if any(greedy):
                one_hot = torch.zeros_like(probs).scatter_(
                    1, target.argmax(dim=1, keepdim=True), 1.0)
                rows = to_device(greedy, dev).repeat_interleave(k + 1)
                probs = torch.where(rows[:, None], one_hot, probs)
            gens = [item.seq.generator for item in items]
            out = rejection_sample(probs.view(batch, k + 1, vocab), draft_ids, num_draft,
                                   self._draft_probs(items, k, vocab, dev),
                                   uniform_rows(gens, k, dev), exponential_rows(gens, vocab, dev))
            tokens, num_accepted = out.token_ids, out.num_accepted
        # one device-to-host copy: the emitted tokens and, last, the accepted counts
        table = torch.cat([tokens, num_accepted[:, None]], dim=1).tolist()
        accepted = [row[-1] for row in table]
        self._count(items, accepted)
        return [row[:a + 1] for row, a in zip(table, accepted, strict=True)]

    @staticmethod
    def _draft_probs(items: list[VerifyItem], k: int, vocab: int, dev: torch.device
                     ) -> torch.Tensor | None:
        """Gives the draft model's distributions padded to [B, k, vocab], None for n-gram."""
        if all(item.drafts.probs is None for item in items):
            return None
        out = torch.zeros(len(items), k, vocab, device=dev)
        for i, item in enumerate(items):
            drafts = item.drafts
            if drafts.probs is None:
                raise AssertionError("a draft model gives every draft's distribution")
            out[i, :len(drafts.token_ids)] = drafts.probs
        return out

    def _count(self, items: list[VerifyItem], accepted: list[int]) -> None:
        c = self.counters
        per_pos = c.num_accepted_tokens_per_pos
        for item, a in zip(items, accepted, strict=True):
            c.num_drafts += 1
            c.num_draft_tokens += len(item.drafts.token_ids)
            c.num_accepted_tokens += a
            for pos in range(a):
                per_pos[pos] += 1


def _verify_greedy(target: torch.Tensor, draft_ids: torch.Tensor, num_draft: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives what `rejection_sample` emits for greedy rows (the tokens up to and including
    the one after the accepted run; the rest is left as is), and how many drafts passed,
    without the distributions: one-hot p and q accept a draft while it equals the target's
    argmax, and the token after the accepted run is the argmax there. `target` [B, K + 1]
    holds the argmax ids; accepted drafts equal them, so they are the emitted tokens."""
    k = draft_ids.shape[1]
    positions = torch.arange(k, device=target.device)[None, :]
    accepted = (target[:, :k] == draft_ids) & (positions < num_draft[:, None])
    return target, accepted.long().cumprod(dim=1).sum(dim=1)


def make_spec_decoder(args: EngineArgs, kv: KVCacheManager, num_blocks: int,
                      device: torch.device, draft: DraftModel | None) -> SpecDecoder | None:
    """Gives the speculative mode `args.speculative_config` asks for (None: off); a draft
    model comes loaded (`load_draft`, before the target sized its KV cache)."""
    spec = parse_speculative_config(args.speculative_config)
    if spec is None:
        return None
    if spec.method == NGRAM:
        proposer: Proposer = NgramProposer(spec)
    elif draft is None:
        raise ValueError(f"speculative_config model={spec.model!r} is not loaded: build the "
                         "engine with LLMEngine.from_engine_args, which loads the draft")
    else:
        proposer = DraftModelProposer(draft, num_blocks, kv, device)
    return SpecDecoder(proposer, kv, spec.num_speculative_tokens)
