"""The engine core's loop: add requests, step (schedule -> run -> sample -> stop checks).

Not thread-safe: one thread (the core process's loop, or the offline LLM)
drives it. Each `step()` returns a delta per request that got new tokens or
finished in that step: its new token ids, not its whole output. Text is decoded
by whoever reads the deltas (`kvpilot.engine.engine_loop.request_state`). With pipeline
parallelism several batches are in flight at once (`engine.batch_queue`); each is
booked as a synchronous step when it comes back.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.fleet_secret import FleetSecret
from kvpilot.engine.contracts.outputs import EngineStats, TokenLogprobs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.speculative import DRAFT, parse_speculative_config
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core.beam_search import apply_selection, select_beams
from kvpilot.engine.core.detokenizer import init_offsets
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.kv_events import KVEventLog
from kvpilot.engine.core.output_processor import OutputProcessor
from kvpilot.engine.core.outputs import EngineCoreOutput
from kvpilot.engine.core.request import Request, Sequence, SequenceStatus
from kvpilot.engine.core.resume import replay_resumed
from kvpilot.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpilot.engine.engine_loop.step_times import StepTimes, StepTokens
from kvpilot.engine.engine_loop.warmup import (
    PathLog,
    check_compile_cache,
    mark_cold,
    request_paths,
    step_paths,
    warm_up,
)
from kvpilot.engine.executor.batch_queue import BatchQueue, PipelinedExecutor
from kvpilot.engine.executor.model_executor import ModelExecutor, make_executor
from kvpilot.engine.kv_connector.host_tier import make_host_tier
from kvpilot.engine.lora.manager import make_lora_manager, unknown_adapter_fix
from kvpilot.engine.spec_decode.proposers import Drafts
from kvpilot.engine.spec_decode.spec_decoder import (
    SpecDecodeCounters,
    SpecDecoder,
    VerifyItem,
    make_spec_decoder,
)
from kvpilot.engine.structured.bitmask import apply_token_bitmask
from kvpilot.engine.structured.matchers import GrammarMatchers, MaskFill
from kvpilot.engine.worker.device import PinnedReadback, resolve_device, to_device
from kvpilot.engine.worker.model_runner import BatchEntry
from kvpilot.engine.worker.row_layout import RowLayout
from kvpilot.engine.worker.sampler import Sampler, SamplingRow, prompt_logprobs
from kvpilot.engine.worker.seeding import seeded_generator

if TYPE_CHECKING:
    from kvpilot.engine.models.config import ModelConfig
    from kvpilot.engine.spec_decode.draft_proposer import DraftModel

# a sampled token the host has not read back yet (async scheduling); never fed to the model:
# the runner patches it on the device from the step in flight
PLACEHOLDER = -1


def needs_host_sampling(params: SamplingParams) -> bool:
    """Gives whether a request's sampling needs the previous token on the host.

    Penalties count output tokens, min_tokens bans stop ids by output length,
    logprobs, n > 1 and beam search fork or read back per-step values: their
    steps run synchronously even under async scheduling. A grammar's mask needs
    the previous token too, but the engine reads it back while the GPU runs the
    next forward (`_step_async`), so structured outputs keep async scheduling.
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


@dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet.

    A batch with grammar rows is sampled only once its mask is filled: until
    `LLMEngine._sampled` queues the sampling, `tokens` is None and the logits,
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


class LLMEngine:
    """A paged-KV engine over one model: continuous batching, prefix caching, preemption."""

    def __init__(self, engine_args: EngineArgs, model_config: ModelConfig, tokenizer: TokenizerLike,
                 runner: ModelExecutor, draft: DraftModel | None = None) -> None:
        self.engine_args = engine_args
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.runner = runner
        # salts the block hashes (the router and the other engines use the same salt) and
        # keys the KV agent of a prefill/decode role
        self.fleet_secret = FleetSecret.from_file(engine_args.fleet_secret_file)
        spec = parse_speculative_config(engine_args.speculative_config)
        self.kv = KVCacheManager(runner.num_blocks, engine_args.block_size,
                                 engine_args.enable_prefix_caching,
                                 cache_prompt_tails=engine_args.role == "prefill",
                                 hash_salt=self.fleet_secret.block_hash_salt)
        # blocks outside the GPU cache: a host tier (--kv-offload-gb), a decode role's pulls
        self.connector = make_host_tier(engine_args, runner, self.kv)
        if self.connector is not None:
            self.kv.pool.on_evict = self.connector.on_evicted
        self.lora = make_lora_manager(engine_args, runner)  # adapters (--enable-lora)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=engine_args.max_num_seqs,
            max_num_batched_tokens=engine_args.max_num_batched_tokens,
            enable_chunked_prefill=engine_args.enable_chunked_prefill,
            policy=engine_args.scheduling_policy,
            max_model_len=model_config.max_model_len,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0), self.kv,
            self.connector, self.lora.slots if self.lora is not None else None)
        self.spec = make_spec_decoder(engine_args, self.kv, runner.num_blocks, runner.device,
                                      draft)
        # short multi-token entries run as single-token rows where a decode graph then
        # replays the step (`engine.row_layout`)
        self.rows = RowLayout.of(runner.load_report())
        # temperature-only batches in one Triton pass on CUDA, as the model's fused kernels
        self.sampler = Sampler(fused=runner.device.type == "cuda")
        self.outputs = OutputProcessor(tokenizer, model_config.eos_token_ids,
                                       model_config.max_model_len)
        self.requests: dict[str, Request] = {}
        self._pending: list[EngineCoreOutput] = []  # aborted / rejected, given by the next step
        self.prompt_tokens = 0
        self.generation_tokens = 0
        # False: step() gives finished requests only, each output whole (the offline LLM);
        # the core process keeps True to stream
        self.stream_outputs = True
        mode = engine_args.async_scheduling
        # pipeline stages overlap batches instead (parallel.config refuses "on" with PP > 1);
        # EngineArgs refuses "on" with speculation, "auto" turns off for it
        self.batch_queue = BatchQueue(runner) if isinstance(runner, PipelinedExecutor) else None
        self.async_scheduling = self.batch_queue is None and spec is None and (
            mode == "on" or (mode == "auto" and runner.device.type == "cuda"))
        self._inflight: _InFlight | None = None
        self._gpu_wait_s = 0.0  # of the last step: waiting for the GPU's sampled tokens
        # of the last step, for the slow-iteration log: phase -> seconds, and its batch
        self._phases: dict[str, float] = {}
        self._last_plan: SchedulerOutput | None = None
        self._last_mode = ""  # how the last step's forward ran: graph, piecewise or eager
        self.step_times = StepTimes()  # engine step wall times by that mode (/metrics)
        self.step_tokens = StepTokens()  # tokens per engine step (/metrics)
        self.paths = PathLog()  # code paths run: the warm-up's, and any first used after it
        # whether the step being built has a prompt with nothing cached before it, and one
        # (or a verify) continuing a cached prefix: its prefill kernels (`_entries` sets them)
        self._prefills = (False, False)
        self._steps_before = (0, 0, 0)  # the runner's step counts when the warm-up ended
        self.startup_seconds = 0.0  # from_engine_args' start to ready (set at its end)
        self._host_sampling: set[str] = set()  # live request ids that need host sampling
        self._readback = PinnedReadback(engine_args.max_num_seqs)  # sampled ids to the host
        self._grammars: GrammarMatchers | None = None  # on the first structured request

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        """Gives an engine with the model, tokenizer and KV cache that `args` describe (a Hub
        id resolved in the local cache), logging each start-up phase (worker/startup_log.py)."""
        from kvpilot.engine.contracts.tokenizer import load_tokenizer
        from kvpilot.engine.models.config import ModelConfig
        from kvpilot.engine.models.hub_cache import with_local_model
        from kvpilot.engine.models.loader import resolve_load_format
        from kvpilot.engine.worker import startup_log as log

        started = time.perf_counter()
        args = with_local_model(args)
        device = resolve_device(args.device)
        if device.type == "cuda":
            check_compile_cache(os.environ)
        torch.manual_seed(args.seed)
        model_config = ModelConfig.from_engine_args(args, device)
        log.log_model(args, model_config.architecture, model_config.num_layers,
                      str(model_config.dtype).removeprefix("torch."), str(device))
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        spec = parse_speculative_config(args.speculative_config)
        draft = None
        if spec is not None and spec.method == DRAFT:
            from kvpilot.engine.spec_decode.draft_proposer import load_draft

            draft = load_draft(args, spec, model_config, device)
        # refuses an unsupported topology before any weight is loaded or process started
        runner = make_executor(args, model_config, device,
                               share_kv_blocks=draft.share_kv_blocks(model_config) if draft
                               else None)
        log.log_load(runner.load_report(), resolve_load_format(model_config, args.load_format),
                     log.kv_budget_source(args, device.type),
                     "CPU" if device.type != "cuda" else "--enforce-eager or the torch "
                     "attention backend", args.tensor_parallel_size * args.pipeline_parallel_size)
        engine = cls(args, model_config, tokenizer, runner, draft)
        log.log_warmup(warm_up(engine) if args.warmup == "on" or (
            args.warmup == "auto" and device.type == "cuda") else mark_cold(engine))
        if device.type == "cuda":
            engine.freeze_gc_heap()
        engine.startup_seconds = time.perf_counter() - started
        log.log_ready(time.perf_counter() - started, model_config.max_model_len,
                      args.max_num_seqs)
        return engine

    @staticmethod
    def freeze_gc_heap() -> None:
        """Moves every object alive now (model, tokenizer, Triton/CUDA state) out of GC scans.

        Each step allocates thousands of short-lived containers, so Python's cyclic
        GC runs full collections every few dozen steps; each one walks the whole
        heap (~0.1 s with the model loaded), stalling the GPU behind the host. A
        frozen startup heap is never walked again (vLLM does the same after start-up).
        Called on CUDA, where host time per step matters.
        """
        gc.collect()
        gc.freeze()

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_name: str | None = None) -> None:
        """Queues a request (with LoRA adapter `lora_name`, None: the base model); raises
        ValueError naming the field when it is invalid."""
        if request_id in self.requests:
            raise ValueError(f"request_id={request_id!r} is already running: use a unique id")
        if lora_name is not None and (self.lora is None or lora_name not in self.lora.adapters):
            raise ValueError(f"model={lora_name!r} is not a loaded LoRA adapter: "
                             f"{unknown_adapter_fix(self.lora)}")
        if isinstance(prompt, str):
            text, token_ids = prompt, list(self.tokenizer.encode(prompt))
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: send at least one token")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}): got "
                             f"{[t for t in token_ids if not 0 <= t < vocab][:5]}")
        if params.first_token_id is not None and params.first_token_id >= vocab:
            raise ValueError(f"first_token_id={params.first_token_id} is invalid: "
                             f"first_token_id must be in [0, {vocab})")
        resumed = params.resume_token_ids
        if resumed and any(t >= vocab for t in resumed):
            raise ValueError(f"resume_token_ids has ids outside [0, {vocab}): "
                             f"{[t for t in resumed if t >= vocab][:5]}")
        request = Request(request_id, text, token_ids, params,
                          time.monotonic() if arrival_time is None else arrival_time, priority,
                          lora_name=lora_name)
        reason = self.scheduler.exceeds_model_len(request)
        if reason is not None:
            raise ValueError(reason)
        seq = request.seqs[0]
        init_offsets(seq)
        if resumed:
            replay_resumed(seq, resumed, self.outputs)
        if params.structured_outputs is not None:
            self.grammars().add(request)
        reason = self.scheduler.never_fits(request)
        self._seed(seq)
        if reason is not None or seq.finish_reason is not None:
            # fits the model but not this KV pool: finish at once rather than stall the queue;
            # or the resumed tokens ended the output (the client got its end but not the rest
            # of the stream): finish with nothing more to send
            if reason is not None:
                request.error = reason
                seq.finish_reason = "error"
            seq.status = SequenceStatus.FINISHED
            request.metrics.finished_time = time.monotonic()
            self._pending.append(self.outputs.build(request))
            return
        self.requests[request_id] = request
        self.paths.use(request_paths(params, lora_name is not None))
        if needs_host_sampling(params):
            self._host_sampling.add(request_id)
        else:  # a grammar masks its verify rows (`_mask_verify_rows`)
            request.speculate = self.spec is not None
        self.scheduler.add(seq)

    def grammars(self) -> GrammarMatchers:
        """Gives the structured-output matchers (made on first use: the grammar library reads
        the whole vocabulary); raises ValueError when the tokenizer cannot give its JSON."""
        if self._grammars is None:
            to_json = getattr(self.tokenizer, "to_json", None)
            if to_json is None:
                raise ValueError("structured_outputs needs the model's tokenizer.json: load a "
                                 "model with one, or drop structured_outputs")
            self._grammars = GrammarMatchers(to_json(), self.model_config.vocab_size,
                                             list(self.model_config.eos_token_ids),
                                             self.runner.device)
        return self._grammars

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serves the PEFT adapter at `lora_path` as `lora_name` from the next request on;
        raises ValueError naming the field and the fix when it cannot."""
        if self.lora is None:
            raise ValueError(f"lora_name={lora_name!r}: {unknown_adapter_fix(None)}")
        self.lora.add(lora_name, lora_path)

    def lora_adapters(self) -> dict[str, str]:
        """Gives the LoRA adapters served, name -> path (none without --enable-lora)."""
        if self.lora is None:
            return {}
        return {name: adapter.path for name, adapter in self.lora.adapters.items()}

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stops serving `lora_name`; raises KeyError when it is not loaded and ValueError
        while requests still use it (nothing is dropped: retry once they finish)."""
        if self.lora is None or lora_name not in self.lora.adapters:
            raise KeyError(lora_name)
        in_use = self.lora.in_use(lora_name, self.requests.values())
        if in_use:
            raise ValueError(f"lora_name={lora_name!r} is in use by {in_use} request(s): "
                             "retry the unload once they finish")
        self.lora.remove(lora_name)

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Stops requests, frees their blocks; each gets a final output with reason "abort"."""
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            self._host_sampling.discard(request_id)
            for seq in request.live_seqs():
                if seq.inflight_row >= 0:  # drop the placeholder of the step in flight
                    seq.token_ids.pop()
                    seq.inflight_row = -1
                self.scheduler.remove(seq)
                seq.finish_reason = "abort"
            request.metrics.finished_time = time.monotonic()
            self._pending.append(self.outputs.build(request))

    def has_unfinished_requests(self) -> bool:
        """Gives whether a `step` has work (requests, or outputs still to return)."""
        return (bool(self.requests) or bool(self._pending) or self._inflight is not None
                or bool(self.batch_queue and self.batch_queue.batches))

    def _seed(self, seq: Sequence) -> None:
        """Gives a seeded request's sequence its generator, seeded per token (`seeding`)."""
        if seq.request.params.seed is not None:
            seq.generator = torch.Generator(device=self.runner.device)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Runs one scheduled step; gives the deltas of requests that progressed or ended.

        Under async scheduling the step launched here is read back by the next
        call: this call returns the outputs of the previous step, computed by
        the host while the GPU runs this one.
        """
        started = time.perf_counter()
        self._last_mode = ""
        tokens_before = self.prompt_tokens + self.generation_tokens
        results = self._step()
        if self._last_mode:
            self.step_times.observe(self._last_mode, time.perf_counter() - started)
        tokens = self.prompt_tokens + self.generation_tokens - tokens_before
        if self._last_mode or tokens:  # a step that only read back the last batch counts too
            self.step_tokens.observe(tokens)
        return results

    def _step(self) -> list[EngineCoreOutput]:
        results, self._pending = self._pending, []
        if self.batch_queue is not None:
            self._step_pipelined(self.batch_queue, results)
            return results
        self._gpu_wait_s = 0.0
        phases, clock = {}, time.perf_counter
        self._phases, start = phases, clock()
        flight = self._inflight
        if flight is not None and self._host_sampling:
            # a request that samples on the host needs its previous token first
            self._resolve(self._sampled(flight), results)
            self._inflight = flight = None
        plan = self.scheduler.schedule()
        if self.connector is not None:
            self._transfer_kv(plan)
        phases["schedule"], start = clock() - start, clock()
        if plan.is_empty:
            if flight is not None:
                self._resolve(self._sampled(flight), results)
                self._inflight = None
            return results
        drafts = self.spec.prepare(plan) if self.spec is not None else {}
        entries = self._entries(plan)
        if drafts:
            SpecDecoder.fill(plan, entries, drafts)
        run_entries = self.rows.expand(entries)  # the same logits rows, maybe a graph's
        self._last_plan = plan
        launch_async = self.async_scheduling and not self._host_sampling
        constrained = launch_async and self._grammars is not None and any(
            s.request.grammar is not None for s, _ in plan.scheduled)
        mask = None
        if flight is not None:  # the forward takes its last tokens on the device
            flight = self._sampled(flight)
            if constrained:
                mask = self._fill_first(plan, entries, flight)
        # the slow-step log tells the batch's own forward from what led up to it
        phases["prepare"], start = clock() - start, clock()
        runner = self.runner
        before = (runner.num_graph_steps, runner.num_piecewise_steps)
        logits = runner.execute(run_entries, plan.block_copies,
                                flight.tokens if flight is not None else None)
        phases["forward"], start = clock() - start, clock()
        mode = self._last_mode = "graph" if runner.num_graph_steps != before[0] else (
            "piecewise" if runner.num_piecewise_steps != before[1] else "eager")
        # rows in a decode graph ran no prefill kernel (`row_layout`)
        self.paths.use(step_paths(mode, *(self._prefills if mode != "graph" else (False, False)),
                                  bool(drafts)))
        if launch_async:
            self._step_async(plan, entries, logits, flight, results, constrained, mask)
            return results
        self._book(plan, entries, logits, results, drafts)
        phases["sample"] = clock() - start
        return results

    def _fill_first(self, plan: SchedulerOutput, entries: list[BatchEntry], flight: _InFlight
                    ) -> MaskFill | None:
        """Under async scheduling, for a batch with grammar rows whose previous forward is
        done already (the mask fill, not the GPU, bounds the step): reads the previous
        tokens, has the matchers take them and starts this step's mask before launching its
        forward, which then runs beside the fill; gives the mask, else None (the forward
        goes first and `_step_async` starts the fill after it)."""
        if flight.computed is not None and not flight.computed.query():
            return None  # the GPU is still busy: queue this forward first
        start = time.perf_counter()
        self._accept(flight)
        grammars = self._grammars
        assert grammars is not None
        mask = grammars.start_bitmask(self._sampled_seqs(plan, entries))
        self._phases["accept"] = time.perf_counter() - start
        return mask

    def _step_async(self, plan: SchedulerOutput, entries: list[BatchEntry], logits: torch.Tensor,
                    flight: _InFlight | None, results: list[EngineCoreOutput],
                    constrained: bool, mask: MaskFill | None) -> None:
        """Launches the sampling of a step whose forward is queued, reads the previous step's
        tokens back and books both. A batch with grammar rows reads the previous tokens first
        and the matchers take them; their mask then fills on a background thread while this
        thread books the previous step and schedules the next (the GPU runs the forward),
        and the next step queues the sampling (`_sampled`) before its own forward. When the
        fill is the longer of the two, `_fill_first` started `mask` before the forward."""
        phases, clock = self._phases, time.perf_counter
        start = clock()
        if flight is not None and constrained and not flight.accepted:
            self._accept(flight)
            phases["accept"], start = clock() - start, clock()
        launched = self._launch(plan, entries, logits, fill_mask=constrained, mask=mask)
        phases["sample"], start = clock() - start, clock()
        if flight is not None:
            self._resolve(flight, results)
        phases["resolve"] = clock() - start
        start = clock()
        self._advance(plan, launched.seqs)
        phases["advance"] = clock() - start
        self._inflight = launched

    def _step_pipelined(self, queue: BatchQueue, results: list[EngineCoreOutput]) -> None:
        """Submits a new batch while the pipeline has room and one can be scheduled; else
        waits for the oldest batch in flight and books it (see `engine.batch_queue`)."""
        if queue.has_room:
            # as many batches as stages: the sequences split evenly, so the stages overlap
            share = -(-self.scheduler.num_unfinished // queue.executor.max_concurrent_batches)
            plan = self.scheduler.schedule(queue.busy, max(share, 1))
            if not plan.is_empty:
                self._last_plan, self._last_mode = plan, "eager"  # pipeline stages: no graphs
                queue.submit(plan, self._entries(plan))
                self.paths.use(step_paths("eager", *self._prefills, False))
                if queue.has_room:
                    return
        if queue.batches:
            batch, logits = queue.collect()
            self._book(batch.plan, batch.entries, logits, results)

    def _book(self, plan: SchedulerOutput, entries: list[BatchEntry], logits: torch.Tensor,
              results: list[EngineCoreOutput], drafts: dict[int, Drafts] | None = None) -> None:
        """Books a step whose logits are here: computed counts, full blocks, prompt
        logprobs, then sampling and stop checks; `drafts` (speculation) are verified."""
        to_sample: list[tuple[Sequence, int]] = []
        to_verify: list[VerifyItem] = []
        row = 0
        cache_full_blocks = self.kv.cache_full_blocks
        finished = SequenceStatus.FINISHED
        for (seq, num_new), entry in zip(plan.scheduled, entries, strict=True):
            if drafts and seq.seq_id in drafts:
                to_verify.append(VerifyItem(seq, row, drafts[seq.seq_id]))
                row += num_new
                continue
            first_row = row
            if entry.logits == "last":
                row += 1
            elif entry.logits == "all":
                row += num_new
            if seq.status is finished:
                continue  # aborted while its batch was in the pipeline (pipeline parallelism)
            start = seq.num_computed_tokens
            seq.num_computed_tokens = start + num_new
            cache_full_blocks(seq)
            if entry.logits == "all":
                self._record_prompt_logprobs(seq, start, logits[first_row:row])
            if seq.num_computed_tokens == len(seq.token_ids):
                request = seq.request
                if request.forked or request.params.n == 1 or request.is_beam_search:
                    to_sample.append((seq, row - 1))
                else:
                    to_sample.extend(self._branches(seq, row - 1))
        self._collect(self._sample(to_sample, logits), results)
        if to_verify and self.spec is not None:
            if self._grammars is not None:
                logits = self._mask_verify_rows(to_verify, logits, self._grammars)
            self._collect(self._apply_verified(to_verify, self.spec.verify(to_verify, logits)),
                          results)

    @staticmethod
    def _mask_verify_rows(items: list[VerifyItem], logits: torch.Tensor,
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

    def _apply_verified(self, items: list[VerifyItem], emitted: list[list[int]]
                        ) -> list[Request]:
        """Books verified drafts: the pending token and the accepted drafts become computed,
        the emitted tokens are appended (stop checks per token), rejected slots are freed."""
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for item, tokens in zip(items, emitted, strict=True):
            seq = item.seq
            touched[seq.request.request_id] = seq.request
            seq.num_computed_tokens += len(tokens)  # the pending token + the accepted drafts
            for token in tokens:
                if self._grammars is not None:
                    self._grammars.accept(seq, token)
                self._append(seq, token, None, None, now)
                if seq.finish_reason is not None:
                    break
            if not seq.finished:
                self.kv.free_tail(seq, seq.num_computed_tokens)
                self.kv.cache_full_blocks(seq)
        return list(touched.values())

    def _transfer_kv(self, plan: SchedulerOutput) -> None:
        """Runs the connector's part of the step before its forward: evicted blocks out,
        matched blocks in. A sequence whose load failed its checksum goes back to its GPU
        hit and leaves this step; the next computes the rest."""
        connector = self.connector
        assert connector is not None
        meta = connector.build_connector_meta()
        connector.save_kv(meta)  # first: the loads and the forward may write those slots
        connector.start_load_kv(meta)
        failed = connector.wait_for_load()
        if failed:
            for load in failed:
                load.seq.num_computed_tokens = load.num_computed_before
                load.seq.request.num_cached_tokens = load.num_computed_before
            dropped = {load.seq.seq_id for load in failed}
            plan.scheduled = [(s, n) for s, n in plan.scheduled if s.seq_id not in dropped]

    def _entries(self, plan: SchedulerOutput) -> list[BatchEntry]:
        """Gives the runner's batch entries of `plan` (one per scheduled sequence)."""
        now = time.monotonic()
        entries: list[BatchEntry] = []
        # this loop and the ones after it run once per sequence per step (256 at full batch):
        # plain attribute reads, no per-sequence helper calls where one line does
        block_id_array = self.kv.block_id_array
        fresh = cached = False
        for seq, num_new in plan.scheduled:
            request = seq.request
            metrics = request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
            start = seq.num_computed_tokens
            end = start + num_new
            num_prompt = len(request.prompt_token_ids)
            lps = request.prompt_logprobs
            if lps is not None and len(lps) < num_prompt:
                mode = "all"
            else:
                mode = "last" if end == len(seq.token_ids) else "none"
            entry = BatchEntry(seq.token_ids[start:end], start, block_id_array(seq), mode)
            if request.lora_name is not None and self.lora is not None:
                entry.lora_slot = self.lora.device_slot(request.lora_name)
            if seq.inflight_row >= 0 and end == len(seq.token_ids):
                entry.patch_row = seq.inflight_row  # its last token is still being sampled
            entries.append(entry)
            if start < num_prompt:
                self.prompt_tokens += min(end, num_prompt) - start
            if num_new > 1:
                fresh, cached = fresh or start == 0, cached or start > 0
        self._prefills = (fresh, cached)
        return entries

    @staticmethod
    def _sampled_seqs(plan: SchedulerOutput, entries: list[BatchEntry]) -> list[Sequence]:
        """Gives the sequences a step samples, in logits-row order."""
        return [seq for (seq, _), entry in zip(plan.scheduled, entries, strict=True)
                if entry.logits == "last"]

    def _launch(self, plan: SchedulerOutput, entries: list[BatchEntry], logits: torch.Tensor,
                fill_mask: bool = False, mask: MaskFill | None = None) -> _InFlight:
        """Queues sampling of a step's last rows and the copy of the tokens to the host; with
        `fill_mask`, starts filling the grammar mask (unless `mask` is that, started already)
        instead and leaves the sampling to `_sampled` (the matchers must have taken the
        previous step's tokens)."""
        seqs = self._sampled_seqs(plan, entries)
        rows = [SamplingRow(seq.request.params, seq.token_ids, seq.request.num_prompt_tokens,
                            seeded_generator(seq), forced_token_id=forced_first(seq))
                for seq in seqs]
        if len(seqs) != logits.shape[0]:  # rows that finish a prompt chunk only, not sampled
            raise AssertionError("async steps sample every logits row")
        grammars = self._grammars
        if mask is None and fill_mask and grammars is not None:
            mask = grammars.start_bitmask(seqs)
        flight = _InFlight(seqs, logits=logits, rows=rows, mask=mask)
        if mask is None:
            return self._sampled(flight)
        if logits.is_cuda:  # whether the next step may read these tokens before its forward
            flight.computed = torch.cuda.Event()
            flight.computed.record()
        return flight

    def _sampled(self, flight: _InFlight) -> _InFlight:
        """Gives `flight` with its sampling queued (waiting for its grammar mask first, if
        any) and the copy of its tokens to the host started."""
        if flight.tokens is not None:
            return flight
        assert flight.logits is not None and flight.rows is not None
        bitmask = None
        if flight.mask is not None:
            waited = time.perf_counter()
            bitmask = flight.mask.wait()
            self._phases["mask_wait"] = time.perf_counter() - waited
            if self._grammars is not None:
                self._phases["grammar"] = self._grammars.fill_seconds
        logits, rows = flight.logits, flight.rows
        flight.logits = flight.rows = flight.mask = None
        tokens = self.sampler.sample_ids(logits, rows, bitmask) if flight.seqs else \
            logits.new_empty(0, dtype=torch.long)
        flight.tokens = tokens
        if tokens.device.type != "cuda":
            flight.host = tokens
        else:
            flight.host, flight.ready = self._readback.start(tokens)
        return flight

    def _advance(self, plan: SchedulerOutput, sampled: list[Sequence]) -> None:
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

    def _wait(self, flight: _InFlight) -> list[int]:
        """Gives a sampled step's tokens on the host, waiting for them (read once)."""
        if flight.token_ids is None:
            if flight.ready is not None:
                waited = time.perf_counter()
                flight.ready.synchronize()
                self._gpu_wait_s += time.perf_counter() - waited
            assert flight.host is not None
            flight.token_ids = flight.host.tolist()
        return flight.token_ids

    def _accept(self, flight: _InFlight) -> None:
        """Has the grammar matchers take a launched step's tokens (before `_resolve` books
        them), so the next mask can be filled meanwhile."""
        grammars = self._grammars
        assert grammars is not None
        for seq, token in zip(flight.seqs, self._wait(self._sampled(flight)), strict=True):
            if seq.inflight_row >= 0:  # else finished or aborted since the launch
                grammars.accept(seq, token)
        flight.accepted = True

    def _resolve(self, flight: _InFlight, results: list[EngineCoreOutput]) -> None:
        """Reads a launched (and sampled) step's tokens back and applies them (stop checks,
        outputs).

        Every sampled sequence ends with the step's placeholder; one that
        finished or was aborted meanwhile has none and its token is dropped.
        """
        token_ids = self._wait(flight)
        now = time.monotonic()
        touched: dict[str, Request] = {}
        grammars = None if flight.accepted else self._grammars
        for seq, token in zip(flight.seqs, token_ids, strict=True):
            if seq.inflight_row < 0:
                continue  # finished or aborted since the launch
            seq.inflight_row = -1
            seq.token_ids.pop()
            if grammars is not None:
                grammars.accept(seq, token)
            self._append(seq, token, None, None, now)
            touched[seq.request.request_id] = seq.request
        self._collect(touched.values(), results)

    def _collect(self, touched: Iterable[Request], results: list[EngineCoreOutput]) -> None:
        """Adds the outputs of requests that got tokens; forgets the finished ones."""
        finished_time = time.monotonic()
        for request in touched:
            finished = request.finished
            if finished:
                request.metrics.finished_time = finished_time
                self.requests.pop(request.request_id, None)
                self._host_sampling.discard(request.request_id)
            if finished or (self.stream_outputs and not request.is_beam_search):
                results.append(self.outputs.build(request))

    def _branches(self, seq: Sequence, row: int) -> list[tuple[Sequence, int]]:
        """Gives the n sequences sampling from logits row `row`, forking the n - 1 new ones.

        Called once per n > 1 request, when its prompt is done (step() checks `forked`).
        """
        request = seq.request
        request.forked = True
        out = [(seq, row)]
        for index in range(1, request.params.n):
            child = self._fork(seq)
            child.index = index
            self._seed(child)
            out.append((child, row))
        return out

    def _fork(self, parent: Sequence) -> Sequence:
        child = parent.fork()
        self.kv.fork(parent, child)
        if parent.status is SequenceStatus.RUNNING:
            self.scheduler.add_running(child)
        else:
            self.scheduler.add(child)
        return child

    def _sample(self, to_sample: list[tuple[Sequence, int]], logits: torch.Tensor
                ) -> list[Request]:
        if not to_sample:
            return []
        eos = self.model_config.eos_token_ids
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
        grammars = self._grammars
        bitmask = grammars.bitmask([seq for seq, _ in to_sample]) if grammars else None
        if grammars is not None:
            self._phases["grammar"] = grammars.fill_seconds
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
            self._append(seq, out.token_ids[i], lp, lp_map, now)
        for request in touched.values():
            if request.is_beam_search:
                chosen = select_beams(request)
                if chosen is not None:
                    apply_selection(request, chosen, self._fork, self._drop_beam,
                                    lambda s, t, lp: self._append(s, t, lp, None, now))
        return list(touched.values())

    def _append(self, seq: Sequence, token: int, lp: float | None, lp_map: TokenLogprobs | None,
                now: float) -> None:
        metrics = seq.request.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        self.generation_tokens += 1
        self.outputs.append_token(seq, token, lp_map, lp)
        if seq.finish_reason is not None:
            self.scheduler.remove(seq)

    def _drop_beam(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        seq.request.seqs.remove(seq)

    def _record_prompt_logprobs(self, seq: Sequence, start: int, logits: torch.Tensor) -> None:
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

    # ---- stats and seams ------------------------------------------------------------------

    def reset_after_warmup(self) -> None:
        """Puts the engine back as it was before the warm-up's requests (all finished): an
        empty prefix cache and event log, counters and step times at zero."""
        self.kv.pool.reset_prefix_cache()  # (its "cleared" event tells the router so)
        self.kv.prefix_cache_queries = self.kv.prefix_cache_hits = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.scheduler.num_preemptions = 0
        self.step_times = StepTimes()
        self.step_tokens = StepTokens()
        runner = self.runner
        self._steps_before = (runner.num_graph_steps, runner.num_piecewise_steps,
                              runner.num_eager_steps)
        if self.spec is not None:
            per_pos = self.spec.counters.num_accepted_tokens_per_pos
            self.spec.counters = SpecDecodeCounters(num_accepted_tokens_per_pos=[0] * len(per_pos))

    @property
    def kv_events(self) -> KVEventLog:
        """Gives the prefix cache's event log (blocks stored/evicted) that GET /kv_events reads."""
        return self.kv.pool.events

    def step_timing(self) -> str:
        """Says where the last step's time went (for the slow-iteration log)."""
        phases = ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in self._phases.items())
        plan = self._last_plan
        batch = (f"{len(plan.scheduled)} seqs, {sum(n for _, n in plan.scheduled)} tokens, "
                 f"{self._last_mode or 'no forward'}, "
                 f"{len(plan.block_copies)} block copies") if plan else "no batch"
        return f"GPU wait {self._gpu_wait_s * 1e3:.1f} ms [{phases} ms; {batch}]"

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Has `callback(reason)` called, from another thread, if the executor breaks between
        steps (a tensor-parallel worker died)."""
        self.runner.on_failure(callback)

    def shutdown(self) -> None:
        """Stops the executor's worker processes (a tensor-parallel engine's; none on one rank)."""
        self.runner.shutdown()
        if self._grammars is not None:
            self._grammars.shutdown()

    def get_stats(self) -> EngineStats:
        """Gives the gauges and counters the server exports."""
        running = {s.request.request_id for s in self.scheduler.running}
        waiting = [r for r in self.requests.values() if r.request_id not in running]
        stats = EngineStats(
            num_running=len(running),
            num_waiting=len(waiting),
            num_waiting_prompt_tokens=sum(r.num_prompt_tokens for r in waiting),
            kv_cache_usage=self.kv.usage,
            num_total_blocks=self.kv.num_blocks,
            block_size=self.kv.block_size,
            max_num_seqs=self.scheduler.config.max_num_seqs,
            num_free_blocks=self.kv.pool.num_free_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            graph_steps=self.runner.num_graph_steps - self._steps_before[0],
            piecewise_steps=self.runner.num_piecewise_steps - self._steps_before[1],
            eager_steps=self.runner.num_eager_steps - self._steps_before[2],
            step_seconds={mode: list(c) for mode, c in self.step_times.counts.items()},
            step_seconds_sum=dict(self.step_times.sums),
            startup_seconds=self.startup_seconds,
            iteration_tokens=list(self.step_tokens.counts),
            iteration_tokens_sum=self.step_tokens.sum,
        )
        if self.spec is not None:
            c = self.spec.counters
            stats.spec_decode_num_drafts = c.num_drafts
            stats.spec_decode_num_draft_tokens = c.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = c.num_accepted_tokens
            stats.spec_decode_num_accepted_tokens_per_pos = list(c.num_accepted_tokens_per_pos)
        if self.connector is not None:
            self.connector.stats().add_to(stats)
        if self.lora is not None:
            self.lora.add_to(stats, [s.request for s in self.scheduler.running], waiting)
        return stats
