"""Async scheduling's step in flight: step n+1's forward launched before step n's sampled
tokens are read back (decision 0008).

A launched step's sampled sequences each end with a placeholder the runner patches on the
device from the step in flight; the tokens reach the host through pinned buffers and are
booked (stop checks, outputs) one step later. A batch with grammar rows is sampled only
once its mask is filled: the matchers take the previous step's tokens first, the mask fills
on a background thread while the GPU runs the forward, and the next step queues the
sampling before its own forward. Requests whose sampling needs the previous token on the
host (`needs_host_sampling`) drain the flight and run synchronously.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvpilot.engine.contracts.outputs import TokenLogprobs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.core.request import Request, Sequence, SequenceStatus
from kvpilot.engine.worker.device import PinnedReadback
from kvpilot.engine.worker.sampler import Sampler, SamplingRow
from kvpilot.engine.worker.seeding import seeded_generator

if TYPE_CHECKING:
    from kvpilot.engine.core.kv_cache_manager import KVCacheManager
    from kvpilot.engine.core.outputs import EngineCoreOutput
    from kvpilot.engine.core.scheduler import SchedulerOutput
    from kvpilot.engine.structured.matchers import GrammarMatchers, MaskFill
    from kvpilot.engine.worker.step_batch import BatchEntry

# a sampled token the host has not read back yet (async scheduling); never fed to the model:
# the runner patches it on the device from the step in flight
PLACEHOLDER = -1


def needs_host_sampling(params: SamplingParams) -> bool:
    """Gives whether a request's sampling needs the previous token on the host.

    Penalties count output tokens, min_tokens bans stop ids by output length,
    logprobs, n > 1 and beam search fork or read back per-step values: their
    steps run synchronously even under async scheduling. A grammar's mask needs
    the previous token too, but the engine reads it back while the GPU runs the
    next forward (`AsyncFlights.step`), so structured outputs keep async scheduling.
    """
    return bool(params.n > 1
                or params.beam_width > 1 or params.logprobs is not None
                or params.prompt_logprobs is not None or params.min_tokens
                or params.presence_penalty or params.frequency_penalty
                or params.repetition_penalty != 1.0)


def forced_first(seq: Sequence) -> int | None:
    """Gives the token `seq` emits instead of sampling: its request's `first_token_id` while
    it has no output yet (a disaggregated prefill engine sampled that token already)."""
    return seq.request.params.first_token_id if seq.num_output_tokens == 0 else None


def sampled_seqs(plan: SchedulerOutput, entries: list[BatchEntry]) -> list[Sequence]:
    """Gives the sequences a step samples, in logits-row order."""
    return [seq for (seq, _), entry in zip(plan.scheduled, entries, strict=True)
            if entry.logits == "last"]


class StepBook(Protocol):
    """Where a step's tokens are booked: the engine's stop checks and outputs."""

    def append_token(self, seq: Sequence, token: int, lp: float | None,
                     lp_map: TokenLogprobs | None, now: float) -> None:
        """Appends `token` to `seq` (stop checks; a finished sequence leaves the scheduler)."""
        ...

    def collect(self, touched: Iterable[Request], results: list[EngineCoreOutput]) -> None:
        """Adds the outputs of requests that got tokens; forgets the finished ones."""
        ...


@dataclass
class InFlight:
    """A launched step whose sampled tokens the host has not read yet.

    A batch with grammar rows is sampled only once its mask is filled: until
    `AsyncFlights.sampled` queues the sampling, `tokens` is None and the logits,
    rows and mask being filled wait here.
    """

    seqs: list[Sequence]  # in sampled-row order
    tokens: torch.Tensor | None = None  # [len(seqs)] long, on the model's device
    host: torch.Tensor | None = None  # the tokens' host copy (pinned on CUDA), once `ready`
    ready: torch.cuda.Event | None = None
    logits: torch.Tensor | None = None  # until sampled
    rows: list[SamplingRow] | None = None
    mask: MaskFill | None = None
    computed: torch.cuda.Event | None = None  # recorded after the forward, while not sampled
    accepted: bool = False  # the grammar matchers took these tokens already
    token_ids: list[int] | None = None  # the tokens on the host, once read


class AsyncFlights:
    """The step in flight under async scheduling, and how it is launched, read and booked."""

    def __init__(self, sampler: Sampler, kv: KVCacheManager, book: StepBook,
                 grammars: Callable[[], GrammarMatchers | None], max_num_seqs: int) -> None:
        self.sampler = sampler
        self.kv = kv
        self.book = book
        self.grammars = grammars  # the engine's matchers, once a structured request came
        self.readback = PinnedReadback(max_num_seqs)  # sampled ids to the host
        self.inflight: InFlight | None = None
        self.gpu_wait_s = 0.0  # of the last step: waiting for the GPU's sampled tokens
        # of the last step, for the slow-iteration log: phase -> seconds (the engine's)
        self.phases: dict[str, float] = {}

    def fill_first(self, plan: SchedulerOutput, entries: list[BatchEntry], flight: InFlight
                   ) -> MaskFill | None:
        """For a batch with grammar rows whose previous forward is done already (the mask
        fill, not the GPU, bounds the step): reads the previous tokens, has the matchers
        take them and starts this step's mask before launching its forward, which then runs
        beside the fill; gives the mask, else None (the forward goes first and `step` starts
        the fill after it)."""
        if flight.computed is not None and not flight.computed.query():
            return None  # the GPU is still busy: queue this forward first
        start = time.perf_counter()
        self.accept(flight)
        grammars = self.grammars()
        assert grammars is not None
        mask = grammars.start_bitmask(sampled_seqs(plan, entries))
        self.phases["accept"] = time.perf_counter() - start
        return mask

    def step(self, plan: SchedulerOutput, entries: list[BatchEntry], logits: torch.Tensor,
             flight: InFlight | None, results: list[EngineCoreOutput], constrained: bool,
             mask: MaskFill | None) -> None:
        """Launches the sampling of a step whose forward is queued, reads the previous step's
        tokens back and books both. A batch with grammar rows reads the previous tokens first
        and the matchers take them; their mask then fills on a background thread while this
        thread books the previous step and schedules the next (the GPU runs the forward),
        and the next step queues the sampling (`sampled`) before its own forward. When the
        fill is the longer of the two, `fill_first` started `mask` before the forward."""
        phases, clock = self.phases, time.perf_counter
        start = clock()
        if flight is not None and constrained and not flight.accepted:
            self.accept(flight)
            phases["accept"], start = clock() - start, clock()
        launched = self.launch(plan, entries, logits, fill_mask=constrained, mask=mask)
        phases["sample"], start = clock() - start, clock()
        if flight is not None:
            self.resolve(flight, results)
        phases["resolve"] = clock() - start
        start = clock()
        self.advance(plan, launched.seqs)
        phases["advance"] = clock() - start
        self.inflight = launched

    def launch(self, plan: SchedulerOutput, entries: list[BatchEntry], logits: torch.Tensor,
               fill_mask: bool = False, mask: MaskFill | None = None) -> InFlight:
        """Queues sampling of a step's last rows and the copy of the tokens to the host; with
        `fill_mask`, starts filling the grammar mask (unless `mask` is that, started already)
        instead and leaves the sampling to `sampled` (the matchers must have taken the
        previous step's tokens)."""
        seqs = sampled_seqs(plan, entries)
        rows = [SamplingRow(seq.request.params, seq.token_ids, seq.request.num_prompt_tokens,
                            seeded_generator(seq), forced_token_id=forced_first(seq))
                for seq in seqs]
        if len(seqs) != logits.shape[0]:  # rows that finish a prompt chunk only, not sampled
            raise AssertionError("async steps sample every logits row")
        grammars = self.grammars()
        if mask is None and fill_mask and grammars is not None:
            mask = grammars.start_bitmask(seqs)
        flight = InFlight(seqs, logits=logits, rows=rows, mask=mask)
        if mask is None:
            return self.sampled(flight)
        if logits.is_cuda:  # whether the next step may read these tokens before its forward
            flight.computed = torch.cuda.Event()
            flight.computed.record()
        return flight

    def sampled(self, flight: InFlight) -> InFlight:
        """Gives `flight` with its sampling queued (waiting for its grammar mask first, if
        any) and the copy of its tokens to the host started."""
        if flight.tokens is not None:
            return flight
        assert flight.logits is not None and flight.rows is not None
        bitmask = None
        if flight.mask is not None:
            waited = time.perf_counter()
            bitmask = flight.mask.wait()
            self.phases["mask_wait"] = time.perf_counter() - waited
            grammars = self.grammars()
            if grammars is not None:
                self.phases["grammar"] = grammars.fill_seconds
        logits, rows = flight.logits, flight.rows
        flight.logits = flight.rows = flight.mask = None
        tokens = self.sampler.sample_ids(logits, rows, bitmask) if flight.seqs else \
            logits.new_empty(0, dtype=torch.long)
        flight.tokens = tokens
        if tokens.device.type != "cuda":
            flight.host = tokens
        else:
            flight.host, flight.ready = self.readback.start(tokens)
        return flight

    def advance(self, plan: SchedulerOutput, sampled: list[Sequence]) -> None:
        """Books a launched step: computed counts, full blocks, a placeholder per sampled row."""
        cache_full_blocks = self.kv.cache_full_blocks
        finished = SequenceStatus.FINISHED
        for seq, num_new in plan.scheduled:
            if seq.status is finished:
                continue  # stopped by the step just resolved: its row here is discarded
            seq.num_computed_tokens += num_new
            cache_full_blocks(seq)
        for row, seq in enumerate(sampled):
            if seq.status is not finished:
                seq.token_ids.append(PLACEHOLDER)
                seq.inflight_row = row

    def wait(self, flight: InFlight) -> list[int]:
        """Gives a sampled step's tokens on the host, waiting for them (read once)."""
        if flight.token_ids is None:
            if flight.ready is not None:
                waited = time.perf_counter()
                flight.ready.synchronize()
                self.gpu_wait_s += time.perf_counter() - waited
            assert flight.host is not None
            flight.token_ids = flight.host.tolist()
        return flight.token_ids

    def accept(self, flight: InFlight) -> None:
        """Has the grammar matchers take a launched step's tokens (before `resolve` books
        them), so the next mask can be filled meanwhile."""
        grammars = self.grammars()
        assert grammars is not None
        # one batch on llguidance's threads (the fill waits for it), not a call per row
        grammars.accept_tokens([
            (seq, token) for seq, token in zip(flight.seqs, self.wait(self.sampled(flight)),
                                               strict=True)
            if seq.inflight_row >= 0])  # else finished or aborted since the launch
        flight.accepted = True

    def resolve(self, flight: InFlight, results: list[EngineCoreOutput]) -> None:
        """Reads a launched (and sampled) step's tokens back and applies them (stop checks,
        outputs).

        Every sampled sequence ends with the step's placeholder; one that
        finished or was aborted meanwhile has none and its token is dropped.
        """
        token_ids = self.wait(flight)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        grammars = None if flight.accepted else self.grammars()
        if grammars is not None:
            grammars.accept_tokens([(seq, token) for seq, token in
                                    zip(flight.seqs, token_ids, strict=True)
                                    if seq.inflight_row >= 0])
        for seq, token in zip(flight.seqs, token_ids, strict=True):
            if seq.inflight_row < 0:
                continue  # finished or aborted since the launch
            seq.inflight_row = -1
            seq.token_ids.pop()
            self.book.append_token(seq, token, None, None, now)
            touched[seq.request.request_id] = seq.request
        self.book.collect(touched.values(), results)
