"""Ready means warm: before the engine says ready, every code path real traffic takes has run.

A path's first use compiles: Triton kernels (the prefill kernels, the sampler's), the
llguidance tokenizer of the first structured request, cuBLAS's choice for a GEMM shape.
Measured on an H200 before this warm-up, the first 64-prompt batch of a fresh 8B-shaped
server spent 2.4 s in its forward and 0.6 s in the sampler: a replica an autoscaler had
just added answered its first users seconds late.

Decode graphs and the mixed steps' piecewise graphs are captured (and so compiled) at
start-up; `warm_up` then runs synthetic requests through the engine's own step loop
until each path below has run, and puts the engine back as it was (no request, an empty
prefix cache, counters at zero):

- a prefill as wide as the step budget (`--max-num-batched-tokens`), and one continuing
  a cached prefix (a prefix hit, or the second chunk of a chunked prompt);
- decode steps and mixed steps beside them (graphs, piecewise graphs): at the end a prompt
  as wide as the largest mixed graph arrives while another request decodes;
- the sampler's paths: greedy, random (temperature only, alone: a batch the fused kernel
  draws on CUDA), top-k/top-p/min-p, seeded, penalties, logit bias, logprobs, prompt
  logprobs, min_tokens;
- a structured (json_schema) request: the grammar compiler and the token bitmask;
- an adapter's rows, when `--lora-modules` loaded one at start-up (an adapter loaded later
  may compile its shapes on first use; the path log says so);
- speculative verifies, when `--speculative-config` is set.

`PathLog` names the paths every step takes (`request_paths`, `step_paths`); after the
warm-up it logs any path first used later (a path the warm-up missed), which the tests
check stays empty for every kind of request.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.engine_loop.engine_core import ModelLimits
from kvpilot.engine.worker.piecewise_graphs import MAX_TOKENS as MIXED_MAX_TOKENS
from kvpilot.engine.worker.startup_log import WarmupReport

logger = logging.getLogger("kvpilot.engine")
# bounds the warm-up's step loop (its requests finish in a few dozen steps)
MAX_STEPS = 2000
WARMUP_SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                            "required": ["n"]})


def request_paths(params: SamplingParams, lora: bool) -> list[str]:
    """Gives the code paths a request's sampling parameters take (see the module)."""
    paths = []
    if params.greedy:
        paths.append("sampler:greedy")
    elif params.top_k or params.top_p < 1 or params.min_p or params.seed is not None:
        # the torch path's sort, filters and per-request generators
        paths.append("sampler:top-k/top-p/min-p/seeded")
    else:  # the fused kernel on CUDA
        paths.append("sampler:temperature")
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1:
        paths.append("sampler:penalties")
    if params.logit_bias:
        paths.append("sampler:logit-bias")
    if params.logprobs is not None:
        paths.append("sampler:logprobs")
    if params.prompt_logprobs is not None:
        paths.append("prompt-logprobs")
    if params.min_tokens:
        paths.append("sampler:min-tokens")
    if params.structured_outputs is not None:
        paths.append("structured-outputs")
    if lora:
        paths.append("lora")
    return paths


def step_paths(forward: str, fresh_prefill: bool, cached_prefix: bool, verify: bool
               ) -> list[str]:
    """Gives the code paths a step takes: its forward's mode, its prefill kernels (a prompt
    with nothing cached before it, one continuing a cached prefix), speculative verifies."""
    paths = [f"forward:{forward}"]
    if fresh_prefill:
        paths.append("prefill:fresh")
    if cached_prefix:
        paths.append("prefill:cached-prefix")
    if verify:
        paths.append("spec:verify")
    return paths


def check_compile_cache(environ: Mapping[str, str]) -> None:
    """Raises ValueError naming the fix unless Triton's cache directory (TRITON_CACHE_DIR; the
    operator may mount a node directory there) can be written: otherwise the warm-up's
    compiles would fail, or be lost, far from the cause."""
    path = environ.get("TRITON_CACHE_DIR")
    if not path:
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(f"TRITON_CACHE_DIR={path} cannot be written ({exc.strerror}): make "
                         "it writable by the engine's user (a node directory: install -d -o "
                         "1000 -g 1000 DIR), or unset the operator's --compile-cache-dir") from exc


class PathLog:
    """The code paths the engine has run; after `mark_warm`, the ones first used since."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.warm: frozenset[str] | None = None  # what the warm-up ran (None: not warm yet)
        self.cold: list[str] = []  # paths first used after the warm-up

    def use(self, paths: Iterable[str]) -> None:
        for path in paths:
            if path in self.seen:
                continue
            self.seen.add(path)
            if self.warm is not None:
                self.cold.append(path)
                logger.warning("first use after ready: %s (the warm-up did not run it, so it "
                               "may compile now)", path)

    def mark_warm(self) -> None:
        self.warm = frozenset(self.seen)


class WarmEngine(Protocol):
    """What the warm-up drives: `LLMEngine` (named here as a protocol, so that the engine can
    import this module)."""

    engine_args: EngineArgs
    paths: PathLog
    spec: Any  # a SpecDecoder, or None without speculation
    lora: Any  # a LoRAManager (its `adapters`: name -> path), or None without LoRA

    @property
    def model_config(self) -> ModelLimits: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_name: str | None = None) -> None: ...

    def step(self) -> Any: ...

    def has_unfinished_requests(self) -> bool: ...

    def reset_after_warmup(self) -> None: ...


@dataclass
class _Request:
    name: str
    prompt: list[int]
    params: SamplingParams
    lora_name: str | None = None


def _requests(engine: WarmEngine) -> tuple[list[_Request], int]:
    """Gives the warm-up's requests and its widest prefill (see the module)."""
    args = engine.engine_args
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(engine.model_config.vocab_size) for _ in range(n)]

    def greedy(**kw: Any) -> SamplingParams:
        return SamplingParams(**{"temperature": 0, "max_tokens": 4, "ignore_eos": True, **kw})

    def sampled(**kw: Any) -> SamplingParams:
        return SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, **kw)

    longest = engine.model_config.max_model_len - 8  # room for the output tokens
    wide = max(1, min(args.max_num_batched_tokens, longest))
    first = prompt(wide)
    requests = [_Request("wide", first, greedy())]
    if args.enable_prefix_caching and wide > 2 * args.block_size:
        # a tail as long as the rest of the budget, run beside the other requests: too many
        # rows for a decode graph (`row_layout`), so the prefix kernel runs
        half = wide // 2
        requests.append(_Request("prefix-hit", first[:half] + prompt(wide - half), greedy()))
    elif args.enable_chunked_prefill and longest > wide:
        requests.append(_Request("chunked", prompt(min(longest, wide + 16)), greedy()))
    requests += [
        _Request("random", prompt(24), sampled()),
        _Request("top", prompt(24), sampled(top_k=20, top_p=0.9, min_p=0.05, seed=7)),
        _Request("penalties", prompt(24), greedy(presence_penalty=0.5, frequency_penalty=0.5,
                                                 repetition_penalty=1.1)),
        _Request("logit-bias", prompt(24), greedy(logit_bias={1: -1.0, 2: 0.5})),
        _Request("logprobs", prompt(24), greedy(logprobs=5, prompt_logprobs=2, min_tokens=2)),
        # (the grammar ends the output with EOS: no ignore_eos)
        _Request("structured", prompt(12), SamplingParams(
            temperature=0, max_tokens=4,
            structured_outputs=StructuredOutputsParams(json=WARMUP_SCHEMA))),
    ]
    # a prompt arriving while another request decodes, as wide as the mixed steps' largest
    # graph less that decode: with a budget over MAX_TOKENS every other warm-up prompt is
    # either wider (eager) or short enough for the decode graphs' rows (`row_layout`)
    requests += [_Request("decoding", prompt(8), greedy(max_tokens=8)),
                 _Request("mixed", prompt(max(1, min(MIXED_MAX_TOKENS, wide) - 1)), greedy())]
    if engine.lora is not None and engine.lora.adapters:  # one loaded at start-up
        requests.append(_Request("lora", prompt(24), greedy(),
                                 lora_name=next(iter(engine.lora.adapters))))
    if engine.spec is not None:
        # the prompt repeats and its first token comes next: the tail is an n-gram seen
        # before, so even an n-gram proposer drafts, and the next step verifies
        repeated = prompt(8) * 4
        requests.append(_Request("speculative", repeated,
                                 greedy(first_token_id=repeated[0], max_tokens=8)))
    return requests, wide


def mark_cold(engine: WarmEngine) -> WarmupReport:
    """Gives the report of a warm-up not run (`--warmup off`, or auto on a CPU, where nothing
    compiles): the path log then records nothing as cold."""
    return WarmupReport(skipped="--warmup off" if engine.engine_args.warmup == "off"
                        else "a CPU engine compiles nothing: --warmup on runs it anyway")


def warm_up(engine: WarmEngine) -> WarmupReport:
    """Runs the warm-up's requests through `engine` and resets it (see the module); gives
    what it ran. Skipped for a prefill or decode role (its requests come with KV transfers)."""
    if engine.engine_args.role != "both":
        engine.paths.mark_warm()
        return WarmupReport(skipped=f"role {engine.engine_args.role}")
    started = time.perf_counter()
    requests, wide = _requests(engine)
    steps = 0

    def add(request: _Request) -> None:
        engine.add_request(f"kvpilot-warmup-{request.name}", request.prompt, request.params,
                           lora_name=request.lora_name)

    def run(limit: int = MAX_STEPS) -> None:
        nonlocal steps
        for _ in range(limit):
            if not engine.has_unfinished_requests() or steps >= MAX_STEPS:
                return
            engine.step()
            steps += 1

    # the widest prompt first, alone, so that its blocks are cached before the prefix hit
    # looks them up (under async scheduling a request added beside it would miss them); then
    # the temperature-only request alone: a batch of it is the fused sampling kernel's (a
    # batch with any other random row takes torch's ops), as a lone chat request's is; last
    # the mixed step: one request decoding (its prefill and first decode launched), then a
    # prompt beside it
    by_name = {r.name: r for r in requests}
    decoding, mixed = by_name["decoding"], by_name["mixed"]
    alone = [r for r in requests[1:] if r.name == "random"]
    rest = [r for r in requests[1:] if r not in (*alone, decoding, mixed)]
    for wave in (requests[:1], alone, rest):
        for request in wave:
            add(request)
        run()
    add(decoding)
    run(limit=2)
    add(mixed)
    run()
    if engine.has_unfinished_requests():
        raise RuntimeError(f"the warm-up's requests did not finish in {MAX_STEPS} steps")
    engine.reset_after_warmup()
    engine.paths.mark_warm()
    return WarmupReport(len(requests), steps, time.perf_counter() - started, wide,
                        frozenset(engine.paths.seen))
