"""A synchronous step's sampling: n > 1 forks, beam search, logprobs and prompt logprobs.

Rows are sampled where their logits are (no step in flight): a request's n completions
fork from one prompt when it is done (`branches`), beams advance in lockstep and are
selected once each live beam has its candidates (`core/beam_search.py`), and a request
that asks for prompt logprobs gets them from its prompt rows (`record_prompt_logprobs`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvpilot.engine.contracts.outputs import TokenLogprobs
from kvpilot.engine.core.beam_search import apply_selection, select_beams
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.output_processor import OutputProcessor
from kvpilot.engine.core.request import Request, Sequence, SequenceStatus
from kvpilot.engine.core.scheduler import Scheduler
from kvpilot.engine.engine_loop.flights import forced_first
from kvpilot.engine.structured.matchers import GrammarMatchers
from kvpilot.engine.worker.device import to_device
from kvpilot.engine.worker.sampler import Sampler, SamplingRow, prompt_logprobs
from kvpilot.engine.worker.seeding import seeded_generator

# appends a token to a sequence: (seq, token, logprob, its logprobs map, now)
AppendToken = Callable[[Sequence, int, "float | None", "TokenLogprobs | None", float], None]


class StepSampling:
    """Samples a synchronous step's rows and books what they give (see the module doc)."""

    def __init__(self, sampler: Sampler, outputs: OutputProcessor, kv: KVCacheManager,
                 scheduler: Scheduler, eos_token_ids: tuple[int, ...] | list[int],
                 device: torch.device, append_token: AppendToken,
                 grammars: Callable[[], GrammarMatchers | None]) -> None:
        self.sampler = sampler
        self.outputs = outputs
        self.kv = kv
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.append_token = append_token
        self.grammars = grammars  # the engine's matchers, once a structured request came

    def seed(self, seq: Sequence) -> None:
        """Gives a seeded request's sequence its generator, seeded per token (`seeding`)."""
        if seq.request.params.seed is not None:
            seq.generator = torch.Generator(device=self.device)

    def branches(self, seq: Sequence, row: int) -> list[tuple[Sequence, int]]:
        """Gives the n sequences sampling from logits row `row`, forking the n - 1 new ones.

        Called once per n > 1 request, when its prompt is done (the engine checks `forked`).
        """
        request = seq.request
        request.forked = True
        out = [(seq, row)]
        for index in range(1, request.params.n):
            child = self.fork(seq)
            child.index = index
            self.seed(child)
            out.append((child, row))
        return out

    def fork(self, parent: Sequence) -> Sequence:
        """Gives a new sequence sharing `parent`'s blocks, scheduled where the parent is."""
        child = parent.fork()
        self.kv.fork(parent, child)
        if parent.status is SequenceStatus.RUNNING:
            self.scheduler.add_running(child)
        else:
            self.scheduler.add(child)
        return child

    def drop_beam(self, seq: Sequence) -> None:
        """Ends a beam no selection chose: out of the scheduler and its request."""
        self.scheduler.remove(seq)
        seq.request.seqs.remove(seq)

    def sample(self, to_sample: list[tuple[Sequence, int]], logits: torch.Tensor,
               phases: dict[str, float]) -> list[Request]:
        """Samples each (sequence, logits row) and appends the tokens (beams: once selected);
        gives the requests that got tokens."""
        if not to_sample:
            return []
        eos = self.eos_token_ids
        rows = []
        for seq, _ in to_sample:
            params = seq.request.params
            banned = None
            if params.min_tokens and seq.num_output_tokens < params.min_tokens:
                banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos))
            num_lp = 2 * params.beam_width if params.beam_width > 1 else (params.logprobs or 0)
            rows.append(SamplingRow(params, seq.token_ids, len(seq.request.prompt_token_ids),
                                    seeded_generator(seq), banned, num_lp,
                                    forced_first(seq)))
        row_ids = [r for _, r in to_sample]
        if row_ids != list(range(logits.shape[0])):
            # forks share a row, prompt-logprob rows are skipped: gather the rows that sample
            logits = logits.index_select(0, to_device(row_ids, logits.device, torch.long))
        grammars = self.grammars()
        bitmask = grammars.bitmask([seq for seq, _ in to_sample]) if grammars else None
        if grammars is not None:
            phases["grammar"] = grammars.fill_seconds
        out = self.sampler(logits, rows, bitmask)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for i, (seq, _) in enumerate(to_sample):
            request = seq.request
            touched[request.request_id] = request
            if request.is_beam_search:
                seq.beam_candidates = list(zip(out.top_logprobs[i], out.top_ids[i], strict=True))
                continue
            lp, lp_map = None, None
            if out.logprobs and request.params.logprobs is not None:
                lp = out.logprobs[i]
                k = request.params.logprobs
                # logprobs=0 (or every row asking for 0): only the sampled token's logprob
                top_ids = out.top_ids[i][:k] if out.top_ids else []
                top_lps = out.top_logprobs[i][:k] if out.top_logprobs else []
                lp_map = self.outputs.token_logprobs(out.token_ids[i], lp, out.ranks[i],
                                                     top_ids, top_lps)
            if bitmask is not None:
                assert grammars is not None
                grammars.accept(seq, out.token_ids[i])
            self.append_token(seq, out.token_ids[i], lp, lp_map, now)
        for request in touched.values():
            if request.is_beam_search:
                chosen = select_beams(request)
                if chosen is not None:
                    apply_selection(request, chosen, self.fork, self.drop_beam,
                                    lambda s, t, lp: self.append_token(s, t, lp, None, now))
        return list(touched.values())

    def record_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Adds the prompt logprobs that the rows of `seq`'s chunk from `start` give."""
        request = seq.request
        lps, k = request.prompt_logprobs, request.params.prompt_logprobs
        if lps is None or k is None:
            return  # only a request that asks for prompt logprobs gets their rows (_entries)
        # row j predicts prompt position start + j + 1; rows already recorded are skipped
        first = max(len(lps) - 1 - start, 0)
        last = min(logits.shape[0], seq.num_prompt_tokens - 1 - start)
        if first >= last:
            return
        targets = request.prompt_token_ids[start + first + 1:start + last + 1]
        computed = prompt_logprobs(logits[first:last], targets, k)
        for token, (lp, rank, ids, top) in zip(targets, computed, strict=True):
            lps.append(self.outputs.token_logprobs(token, lp, rank, ids, top))
