"""Iteration-level scheduling: which sequences compute how many tokens in the next step.

Each step spends a token budget (`max_num_batched_tokens`) on running sequences
first — decodes, then continuing prefill chunks — and then admits waiting ones; under the
`priority` policy a waiting sequence more important than a running prefill is admitted
before that prefill's next chunk.
When the KV cache runs out, the least important running sequence (lowest
priority, then newest arrival) is preempted by recompute: its blocks are freed
and it waits again with its generated tokens kept. Under pipeline parallelism the
sequences of batches still in the pipeline (`busy`) are neither scheduled again nor
preempted until their batch comes back, and a batch takes at most `max_seqs` sequences,
so the running ones split into as many batches as there are stages. With speculative
decoding a decode also reserves slots for k draft tokens (`_num_spec_tokens`), dropped
first when the pool is short; the spec step fills them (`spec_decode/spec_decoder.py`).
"""

from __future__ import annotations

import bisect
from collections.abc import Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.request import Request, Sequence, SequenceStatus
from kvpilot.engine.lora.slots import LoRASlots

if TYPE_CHECKING:
    from kvpilot.engine.core.kv_connector import KVConnector


@dataclass
class SchedulerConfig:
    """The scheduling knobs of EngineArgs."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    max_model_len: int = 2048
    num_speculative_tokens: int = 0  # draft slots reserved per speculating decode


@dataclass
class SchedulerOutput:
    """One step's plan: sequences with their new-token counts (decodes first), and block copies."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Keeps the waiting and running sequences and plans each step."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 connector: KVConnector | None = None,
                 lora_slots: LoRASlots | None = None) -> None:
        self.config = config
        # the LoRA adapters' device slots: a request waits until its adapter has one
        self.lora_slots = lora_slots
        self.kv = kv_manager
        # finds a waiting sequence's blocks outside the GPU cache (host tier, pulled KV)
        self.connector = connector
        self.waiting: list[Sequence] = []  # sorted by _key
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def _key(self, seq: Sequence) -> tuple[int, float, int]:
        """Gives the importance order: smaller is more important."""
        key = seq.sched_key  # fixed per sequence; every step sorts the running list by it
        if key is None:
            priority = seq.request.priority if self.config.policy == "priority" else 0
            key = seq.sched_key = (priority, seq.request.arrival_time, seq.seq_id)
        return key

    def _max_total_tokens(self, request: Request) -> int:
        """Gives the prompt plus the most tokens `request` may generate."""
        max_model_len = self.config.max_model_len
        max_tokens = (request.params.max_tokens
                      or max(max_model_len - request.num_prompt_tokens, 1))
        return request.num_prompt_tokens + max_tokens

    def exceeds_model_len(self, request: Request) -> str | None:
        """Gives why `request` is longer than the model allows, or None when it is not."""
        total, max_model_len = self._max_total_tokens(request), self.config.max_model_len
        if total <= max_model_len:
            return None
        return (f"prompt ({request.num_prompt_tokens} tokens) + max_tokens "
                f"({total - request.num_prompt_tokens}) = {total} exceeds max_model_len="
                f"{max_model_len}: shorten the prompt or lower max_tokens")

    def never_fits(self, request: Request) -> str | None:
        """Gives why `request` can never be scheduled (model length, pool, budget), or None."""
        reason = self.exceeds_model_len(request)
        if reason is not None:
            return reason
        cfg = self.config
        total = self._max_total_tokens(request)
        need = self.kv.num_blocks_needed(total)
        if need > self.kv.num_blocks:
            return (f"the request needs {need} KV blocks ({total} tokens) but the cache has only "
                    f"{self.kv.num_blocks}: raise kv_cache_memory / num_kv_blocks or lower "
                    "max_tokens")
        if not cfg.enable_chunked_prefill and request.num_prompt_tokens > cfg.max_num_batched_tokens:
            return (f"prompt ({request.num_prompt_tokens} tokens) exceeds max_num_batched_tokens="
                    f"{cfg.max_num_batched_tokens} with chunked prefill off: enable chunked "
                    "prefill or raise max_num_batched_tokens")
        return None

    def add(self, seq: Sequence) -> None:
        """Queues `seq` as waiting (new, preempted or forked from a waiting parent)."""
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._key)

    def add_running(self, seq: Sequence) -> None:
        """Adds a forked sequence whose parent is running; its blocks are already shared."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes `seq` out of the queues and frees its blocks (finish or abort)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self, busy: Set[int] = frozenset(), max_seqs: int | None = None
                 ) -> SchedulerOutput:
        """Plans the next step under the token budget, preempting when blocks run out;
        sequences whose ids are in `busy` (in a batch in flight) are left alone, and at most
        `max_seqs` sequences are planned (default: no limit but max_num_seqs)."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        planned: dict[int, tuple[Sequence, int, list[tuple[int, int]]]] = {}
        out = SchedulerOutput()
        key = self._key
        order = sorted(self.running, key=lambda s: (not s.is_decode, key(s)))
        # under `priority`, a waiting request more important than a running prefill is
        # admitted before that prefill's next chunk (else a low band's long prompt, chunked
        # over several steps, takes each step's budget first and a high band's prompt is
        # split behind it)
        first_prefill = next((i for i, s in enumerate(order) if not s.is_decode), None) \
            if cfg.policy == "priority" and self.waiting else None
        running = SequenceStatus.RUNNING
        for i, seq in enumerate(order):
            if i == first_prefill:
                budget = self._admit_waiting(budget, planned, out, max_seqs, before=key(seq))
            if budget == 0 or (max_seqs is not None and len(planned) >= max_seqs):
                break
            num_new = len(seq.token_ids) - seq.num_computed_tokens
            if seq.status is not running or num_new == 0 or seq.seq_id in busy:
                continue  # preempted above, a beam waiting for its siblings, or in flight
            if seq.inflight_row >= 0 and len(seq.token_ids) >= self._max_total_tokens(seq.request):
                continue  # its token in flight is its last (async scheduling): nothing to run
            if not cfg.enable_chunked_prefill and self._must_wait_whole(num_new, budget):
                continue
            num_new = min(num_new, budget)
            if num_new == 1 and seq.request.speculate and seq.num_computed_tokens:
                num_new += min(self._num_spec_tokens(seq), budget - 1)
            copies = self.kv.allocate_slots(seq, num_new)
            if copies is None and num_new > 1 and seq.is_decode:
                num_new = 1  # no room for drafts: decode plainly before preempting anyone
                copies = self.kv.allocate_slots(seq, num_new)
            while copies is None:
                victim = self._victim(busy)
                if victim is None:
                    break
                if victim.seq_id in planned:
                    budget += planned.pop(victim.seq_id)[1]
                self._preempt(victim, out)
                if victim is seq:
                    break
                copies = self.kv.allocate_slots(seq, num_new)
            if copies is None:
                continue
            planned[seq.seq_id] = (seq, num_new, copies)
            budget -= num_new
        self._admit_waiting(budget, planned, out, max_seqs)
        for seq, num_new, copies in planned.values():
            out.scheduled.append((seq, num_new))
            out.block_copies.extend(copies)
        # decodes first: the attention metadata's layout contract
        out.scheduled.sort(key=lambda item: item[1] != 1)
        return out

    def _num_spec_tokens(self, seq: Sequence) -> int:
        """Gives the draft slots to reserve for decode `seq`: k, fewer near its last token.

        Verifying k drafts emits up to k + 1 tokens, so k stays below what `seq` may
        still generate.
        """
        left = self._max_total_tokens(seq.request) - len(seq.token_ids) - 1
        return max(min(self.config.num_speculative_tokens, left), 0)

    def _victim(self, busy: Set[int]) -> Sequence | None:
        """Gives the least important running sequence not in a batch in flight, if any."""
        if not busy:
            return max(self.running, key=self._key)
        return max((s for s in self.running if s.seq_id not in busy), key=self._key,
                   default=None)

    def _has_lora_slot(self, seq: Sequence, in_use: set[str]) -> bool:
        """Gives whether `seq`'s adapter (if any) holds or could take a device slot now."""
        name = seq.request.lora_name
        return (name is None or self.lora_slots is None
                or self.lora_slots.acquire(name, in_use) is not None)

    def _admit_waiting(self, budget: int, planned: dict, out: SchedulerOutput,
                       max_seqs: int | None, before: tuple[int, float, int] | None = None
                       ) -> int:
        """Admits waiting sequences in order while the budget, the sequence limit and the
        KV cache allow (only those more important than `before`, when given); gives the
        budget left."""
        cfg = self.config
        in_use = {name for s in self.running if (name := s.request.lora_name) is not None} \
            if self.lora_slots is not None else set()
        while self.waiting and budget > 0 and (max_seqs is None or len(planned) < max_seqs):
            if len(self.running) >= cfg.max_num_seqs and not self._preempt_idle(out):
                break
            # a preempted beam that already has its candidates waits for selection, not
            # compute; a request whose adapter has no slot waits for one
            seq = next((s for s in self.waiting if s.beam_candidates is None
                        and self._has_lora_slot(s, in_use)), None)
            if seq is None or (before is not None and self._key(seq) >= before):
                break
            hits, hit_tokens = self.kv.get_computed_blocks(seq)
            external = (self.connector.get_num_new_matched_tokens(seq, hit_tokens)
                        if self.connector is not None else 0)
            num_new = seq.num_tokens - hit_tokens - external
            if self._must_wait_whole(num_new, budget):
                break
            num_new = min(num_new, budget)
            copies = self.kv.allocate_slots(seq, num_new, hits, hit_tokens + external)
            while copies is None and self._preempt_idle(out):
                copies = self.kv.allocate_slots(seq, num_new, hits, hit_tokens + external)
            if copies is None:
                break
            if external and self.connector is not None:
                self.connector.update_state_after_alloc(seq, hit_tokens,
                                                        self.kv.block_ids(seq)[len(hits):])
            self.kv.record_prefix_lookup(seq, hit_tokens)
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.num_cached_tokens = hit_tokens + external
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.request.lora_name is not None:
                in_use.add(seq.request.lora_name)
            planned[seq.seq_id] = (seq, num_new, copies)
            budget -= num_new
        return budget

    def _preempt_idle(self, out: SchedulerOutput) -> bool:
        """Preempts the least important running sequence with nothing to compute, if any.

        Such a sequence is a beam holding blocks while it waits for its siblings;
        left in place it could keep a sibling (or anything else) from ever being
        admitted. Gives whether one was preempted.
        """
        idle = [s for s in self.running if s.num_pending_tokens == 0]
        if not idle:
            return False
        self._preempt(max(idle, key=self._key), out)
        return True

    def _must_wait_whole(self, num_new: int, budget: int) -> bool:
        """Gives whether an unchunked prefill must wait for a step with room for all of it.

        A recompute after preemption (prompt plus output) may exceed the whole
        budget; it is chunked anyway, or it would never run.
        """
        cfg = self.config
        return (not cfg.enable_chunked_prefill and num_new > budget
                and num_new <= cfg.max_num_batched_tokens)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
