"""What a request's reader gets (the API server's handlers, the offline `LLM`): its outputs
with text, and the engine's stats.

A streamed request's `RequestOutput`s are deltas: each holds the text, token ids and
logprobs new since the one before. Otherwise a request has one, when it finishes, with
everything. The engine core itself gives token-id deltas without text
(`kvpilot.engine.core.outputs`); `kvpilot.engine.engine_loop.request_state` turns them into these.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability and its rank in the distribution (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str = ""


# token id -> Logprob, holding the sampled token and the top-k alternatives
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request: all of it, or in a stream what is new."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """A request's output: prompt, completions (whole, or in a stream what is new), and
    whether it ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    error: str | None = None


@dataclass
class EngineStats:
    """Gauges and cumulative counters the server exports as Prometheus metrics."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_prompt_tokens: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_total_blocks: int = 0
    block_size: int = 0  # tokens per KV block (0: not known yet)
    max_num_seqs: int = 0  # requests it runs at once (--max-num-seqs; 0: not known yet)
    num_free_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (hits excluded)
    generation_tokens: int = 0
    graph_steps: int = 0  # forwards replayed by a decode graph
    piecewise_steps: int = 0  # mixed steps run by mixed-step graphs (full or piecewise)
    mixed_graph_mode: str = "full"  # attention inside those graphs, or "piecewise": between
    eager_steps: int = 0  # forwards run eagerly (longer steps, pipeline stages, CPU)
    # engine step times by forward mode: per STEP_SECONDS_BUCKETS bound, then +Inf, the
    # steps that fell there (not cumulative), and their sum of seconds
    step_seconds: dict[str, list[int]] = field(default_factory=dict)
    step_seconds_sum: dict[str, float] = field(default_factory=dict)
    startup_seconds: float = 0.0  # from the engine's start to ready (load, graphs, warm-up)
    # engine steps by prompt tokens computed plus tokens generated: per
    # ITERATION_TOKENS_BUCKETS bound, then +Inf (not cumulative), and their sum of tokens
    iteration_tokens: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0
    # speculative decoding (vLLM's spec_decode counters); the list is empty without it
    spec_decode_num_drafts: int = 0  # verifications that had drafts
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # the KV connector's (`kv_connector`; host tier, pulled KV): tokens asked about and found
    # past the GPU prefix hit, blocks moved between the GPU and host memory
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_saved_blocks: int = 0  # evicted GPU blocks copied to the host tier
    kv_offload_loaded_blocks: int = 0  # host-tier blocks copied back instead of recomputed
    kv_offload_failed_blocks: int = 0  # loads that failed their checksum (recomputed)
    kv_offload_dropped_blocks: int = 0  # saves a full host tier (every entry pinned) refused
    kv_offload_evicted_blocks: int = 0  # host-tier entries dropped for room (LRU)
    kv_host_cache_usage: float = 0.0  # fraction of host-tier rows in use, 0..1
    kv_host_blocks: int = 0  # host-tier capacity in blocks (0: no host tier)
    # a prefill/decode engine's KV agent: the transport it pulls by ("tcp" or "nixl"; "" for
    # role both) and its completed pulls by how their blocks moved (NIXL falls back to TCP)
    kv_transport: str = ""
    kv_pulls: dict[str, int] = field(default_factory=dict)
    # LoRA (--enable-lora; max_lora 0: off): adapters of running and of waiting requests
    max_lora: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
