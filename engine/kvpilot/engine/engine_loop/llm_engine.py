"""The engine core's loop: add requests, step (schedule -> run -> sample -> stop checks).

Not thread-safe: one thread (the core process's loop, or the offline LLM)
drives it. Each `step()` returns a delta per request that got new tokens or
finished in that step: its new token ids, not its whole output. Text is decoded
by whoever reads the deltas (`kvpilot.engine.engine_loop.request_state`). With pipeline
parallelism several batches are in flight at once (`executor/batch_queue.py`); each is
booked as a synchronous step when it comes back.

`LLMEngine` composes the step's parts, each in its own module: the step launched under
async scheduling and read back by the next (`flights.py`), a synchronous step's sampling
with its forks, beams and prompt logprobs (`beams.py`), and the booking of speculative
verify rows (`spec_verify.py`)."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.fleet_secret import FleetSecret
from kvpilot.engine.contracts.outputs import EngineStats, TokenLogprobs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.speculative import DRAFT, parse_speculative_config
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.core.detokenizer import init_offsets
from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.core.kv_events import KVEventLog
from kvpilot.engine.core.output_processor import OutputProcessor
from kvpilot.engine.core.outputs import EngineCoreOutput
from kvpilot.engine.core.request import Request, Sequence, SequenceStatus
from kvpilot.engine.core.resume import replay_resumed
from kvpilot.engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpilot.engine.engine_loop.beams import StepSampling
from kvpilot.engine.engine_loop.flights import AsyncFlights, needs_host_sampling
from kvpilot.engine.engine_loop.spec_verify import apply_verified, mask_verify_rows
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
from kvpilot.engine.structured.matchers import GrammarMatchers
from kvpilot.engine.worker.device import resolve_device
from kvpilot.engine.worker.row_layout import RowLayout
from kvpilot.engine.worker.sampler import Sampler
from kvpilot.engine.worker.step_batch import BatchEntry

if TYPE_CHECKING:
    from kvpilot.engine.models.config import ModelConfig
    from kvpilot.engine.spec_decode.draft_proposer import DraftModel


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
        from kvpilot.engine.worker.model_runner import ModelRunner  # loads the model code

        # adapters (--enable-lora): a single-rank runner's adapter layers
        self.lora = make_lora_manager(
            engine_args, runner.lora if isinstance(runner, ModelRunner) else None)
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
        report = runner.load_report()
        self.rows = RowLayout.of(report)
        self._mixed_mode = report.mixed_graph_mode  # how mixed-step graphs hold attention
        # temperature-only batches in one Triton pass on CUDA, as the model's fused kernels
        self.paths = PathLog()  # code paths run: the warm-up's, and any first used after it
        self.sampler = Sampler(fused=runner.device.type == "cuda", on_path=self.paths.use)
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
        # of the last step, for the slow-iteration log: phase -> seconds, and its batch
        self._phases: dict[str, float] = {}
        self._last_plan: SchedulerOutput | None = None
        # how the last step's forward ran: graph, full or piecewise (mixed graphs), or eager
        self._last_mode = ""
        self.step_times = StepTimes()  # engine step wall times by that mode (/metrics)
        self.step_tokens = StepTokens()  # tokens per engine step (/metrics)
        # whether the step being built has a prompt with nothing cached before it, and one
        # (or a verify) continuing a cached prefix: its prefill kernels (`_entries` sets them)
        self._prefills = (False, False)
        self._steps_before = (0, 0, 0)  # the runner's step counts when the warm-up ended
        self.startup_seconds = 0.0  # from_engine_args' start to ready (set at its end)
        self._host_sampling: set[str] = set()  # live request ids that need host sampling
        self._grammars: GrammarMatchers | None = None  # on the first structured request
        # the step launched under async scheduling, read back by the next (`flights.py`)
        self.flights = AsyncFlights(self.sampler, self.kv, self, lambda: self._grammars,
                                    engine_args.max_num_seqs)
        # a synchronous step's sampling: n > 1 forks, beams, logprobs (`beams.py`)
        self.sampling = StepSampling(self.sampler, self.outputs, self.kv, self.scheduler,
                                     model_config.eos_token_ids, runner.device,
                                     self.append_token, lambda: self._grammars)

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
        self.sampling.seed(seq)
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
        else:  # a grammar masks its verify rows (`spec_verify.mask_verify_rows`)
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
                                             self.runner.device,
                                             self.engine_args.structured_outputs_backend)
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
        return (bool(self.requests) or bool(self._pending) or self.flights.inflight is not None
                or bool(self.batch_queue and self.batch_queue.batches))

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
        flights = self.flights
        flights.gpu_wait_s = 0.0
        phases, clock = {}, time.perf_counter
        self._phases = flights.phases = phases
        start = clock()
        flight = flights.inflight
        if flight is not None and self._host_sampling:
            # a request that samples on the host needs its previous token first
            flights.resolve(flights.sampled(flight), results)
            flights.inflight = flight = None
        plan = self.scheduler.schedule()
        if self.connector is not None:
            self._transfer_kv(plan)
        phases["schedule"], start = clock() - start, clock()
        if plan.is_empty:
            if flight is not None:
                flights.resolve(flights.sampled(flight), results)
                flights.inflight = None
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
            flight = flights.sampled(flight)
            if constrained:
                mask = flights.fill_first(plan, entries, flight)
        # the slow-step log tells the batch's own forward from what led up to it
        phases["prepare"], start = clock() - start, clock()
        runner = self.runner
        before = (runner.num_graph_steps, runner.num_piecewise_steps)
        logits = runner.execute(run_entries, plan.block_copies,
                                flight.tokens if flight is not None else None)
        phases["forward"], start = clock() - start, clock()
        mode = self._last_mode = "graph" if runner.num_graph_steps != before[0] else (
            self._mixed_mode if runner.num_piecewise_steps != before[1] else "eager")
        # rows in a decode graph ran no prefill kernel (`row_layout`)
        self.paths.use(step_paths(mode, *(self._prefills if mode != "graph" else (False, False)),
                                  bool(drafts)))
        if launch_async:
            flights.step(plan, entries, logits, flight, results, constrained, mask)
            return results
        self._book(plan, entries, logits, results, drafts)
        phases["sample"] = clock() - start
        return results

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
                self.sampling.record_prompt_logprobs(seq, start, logits[first_row:row])
            if seq.num_computed_tokens == len(seq.token_ids):
                request = seq.request
                if request.forked or request.params.n == 1 or request.is_beam_search:
                    to_sample.append((seq, row - 1))
                else:
                    to_sample.extend(self.sampling.branches(seq, row - 1))
        self.collect(self.sampling.sample(to_sample, logits, self._phases), results)
        if to_verify and self.spec is not None:
            if self._grammars is not None:
                logits = mask_verify_rows(to_verify, logits, self._grammars)
            emitted = self.spec.verify(to_verify, logits)
            self.collect(apply_verified(to_verify, emitted, self.kv, self._grammars,
                                        self.append_token), results)

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

    def collect(self, touched: Iterable[Request], results: list[EngineCoreOutput]) -> None:
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

    def append_token(self, seq: Sequence, token: int, lp: float | None,
                     lp_map: TokenLogprobs | None, now: float) -> None:
        """Appends a sampled `token` to `seq` (stop checks, output offsets); a sequence that
        finished leaves the scheduler."""
        metrics = seq.request.metrics
        metrics.first_token_time = metrics.first_token_time or now
        metrics.last_token_time = now
        self.generation_tokens += 1
        self.outputs.append_token(seq, token, lp_map, lp)
        if seq.finish_reason is not None:
            self.scheduler.remove(seq)

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
        return f"GPU wait {self.flights.gpu_wait_s * 1e3:.1f} ms [{phases} ms; {batch}]"

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
            mixed_graph_mode=self._mixed_mode,
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
