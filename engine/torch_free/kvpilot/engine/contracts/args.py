"""Engine and server command-line flags: the one contract the operator renders into pods.

Torch-free on purpose: the operator imports this module to build the exact
`kvpilot serve` command line a pod runs, and `kvpilot serve --help` reads it
without loading the engine.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ROLES = ("both", "prefill", "decode")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")
ASYNC_SCHEDULING = ("auto", "on", "off")
WARMUP_MODES = ("auto", "on", "off")
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance")
QUANTIZATIONS = ("none", "int8", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
KV_TRANSPORTS = ("tcp", "nixl")  # how a decode engine pulls KV (kv_transfer/nixl_agent.py)
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # server/tool_parsers.py implements each
# With --kv-transfer-port 0 an engine's KV agent listens on its HTTP port plus this.
KV_PORT_OFFSET = 1000
# Engines and routers read their API key from this variable when --api-key is absent (the
# operator sets it from a Secret, so the key never shows in a pod's args).
API_KEY_ENV = "KVPILOT_API_KEY"
FLEET_SECRET_HELP = ("file holding the fleet's secret as hex text (the operator mounts it at "
                     "/var/run/kvpilot/fleet/secret; kvpilot up writes one): authenticates "
                     "KV-agent connections and /kv_events and salts block hashes")
# one of the flag dataclasses (EngineArgs, ServerArgs, RouterArgs)
ArgsT = TypeVar("ArgsT", bound="DataclassInstance")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def resolve_api_key(flag: str | None) -> str | None:
    """Gives the API key: the --api-key flag's, else $KVPILOT_API_KEY's, else None (open)."""
    return flag or os.environ.get(API_KEY_ENV) or None


def parse_size(text: str | int) -> int:
    """Gives a byte count from '512MiB', '2GiB', '1e9'-free plain integers, or an int."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"kv_cache_memory={text!r} is not a size: write e.g. 512MiB or 2GiB")
    number, unit = match.groups()
    unit = (unit or "").upper().removesuffix("B")
    return int(float(number) * _UNITS[unit])


@dataclass
class EngineArgs:
    """Flags of the engine; each field is a `--kebab-case` flag of `kvpilot serve`."""

    model: str = field(metadata={
        "help": "HF-format model directory, a Hub id found in the local Hugging Face cache "
                "(HF_HUB_CACHE, HF_HOME; never downloaded), or a built-in tiny config with "
                "random weights (tiny-llama, tiny-qwen3, tiny-mixtral)"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "name clients use in the `model` field (default: --model)"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer dir (default: model)"})
    load_format: str = field(default="auto", metadata={"choices": LOAD_FORMATS,
        "help": "auto: safetensors when the model dir has them, dummy for built-in configs"})
    dtype: str = field(default="auto", metadata={"choices": DTYPES,
        "help": "auto: bfloat16 on GPU, float32 on CPU"})
    device: str = field(default="auto", metadata={"choices": DEVICES})
    seed: int = 0
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt plus output (default: the model's)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    kv_cache_memory: str | None = field(default=None, metadata={
        "help": "bytes for the KV cache, e.g. 512MiB (CPU default 256MiB)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "fraction of GPU memory the engine may use (GPU only)"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "exact number of KV blocks (overrides the memory budget)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse cached prefix blocks"})
    max_num_seqs: int = field(default=256, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=8192, metadata={
        "help": "token budget of one step (prefill chunks plus decodes)"})
    enable_chunked_prefill: bool = True
    scheduling_policy: str = field(default="fcfs", metadata={"choices": SCHEDULING_POLICIES})
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1
    attention_backend: str = field(default="auto", metadata={"choices": ATTENTION_BACKENDS,
        "help": "auto: triton on CUDA, torch elsewhere"})
    enforce_eager: bool = field(default=False, metadata={"help": "disable CUDA graphs"})
    warmup: str = field(default="auto", metadata={"choices": WARMUP_MODES,
        "help": "run every code path real traffic takes (prefill widths, the sampler's, "
                "structured outputs, speculative verifies) before saying ready, so no first "
                "request waits for a compile; auto: on CUDA"})
    structured_outputs_backend: str = field(default="auto", metadata={
        "choices": STRUCTURED_OUTPUTS_BACKENDS,
        "help": "auto: JSON schemas (response_format json_schema/json_object, guided_json) "
                "by xgrammar, regexes, choices, Lark grammars and schemas with keywords "
                "xgrammar does not enforce by llguidance; guidance: all by llguidance"})
    async_scheduling: str = field(default="auto", metadata={"choices": ASYNC_SCHEDULING,
        "help": "schedule and launch step n+1 while the GPU runs step n (one step of lag on "
                "stop checks); auto: on for CUDA. While any live request has penalties, "
                "logprobs, n > 1, beam search or min_tokens, the whole batch steps "
                "synchronously"})
    role: str = field(default="both", metadata={"choices": ROLES,
        "help": "both: aggregated; prefill/decode: disaggregated roles"})
    kv_transfer_port: int = field(default=0, metadata={
        "help": f"TCP port of the KV-transfer listener (0: the server port + {KV_PORT_OFFSET})"})
    fleet_secret_file: str | None = field(default=None, metadata={"help": FLEET_SECRET_HELP})
    insecure_kv: bool = field(default=False, metadata={
        "help": "run without --fleet-secret-file anyway: a prefill/decode engine's KV port "
                "and any engine's /kv_events then answer whoever reaches them (without this "
                "flag such an engine refuses to start and /kv_events answers 401)"})
    # quantization (issue 23)
    quantization: str = field(default="none", metadata={"choices": QUANTIZATIONS,
        "help": "8-bit projection weights, quantised at load time (a pre-quantised fp8 or "
                "compressed-tensors checkpoint is detected from config.json): int8 weight-only "
                "(W8A16, any device) or fp8 (W8A8, dynamic per-token activation scales, GPUs "
                "with FP8 tensor cores); the LM head and embeddings stay unquantised"})
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES,
        "help": "auto: the model dtype; fp8: E4M3 with per-layer scales (1.0, no calibration "
                "read yet), half the bytes per token so twice the tokens in the same memory "
                "(CPU, or GPUs of compute capability 8.9+); a disaggregated peer must match"})
    # speculative decoding (issue 23)
    speculative_config: str | None = field(default=None, metadata={
        "help": "speculative decoding as vLLM's JSON: '{\"method\": \"ngram\", "
                "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
                "\"prompt_lookup_min\": 2}' or '{\"model\": DRAFT, "
                "\"num_speculative_tokens\": 4}' (a draft sharing the tokenizer); one rank "
                "only, async scheduling off; requests with penalties, logprobs, n > 1, beam "
                "search or min_tokens decode without drafts (structured outputs speculate "
                "within their grammar)"})
    # KV connector (issue 22): a host-memory tier
    kv_offload_gb: float = field(default=0.0, metadata={
        "help": "GiB of host memory (pinned on GPU) for KV blocks evicted from the GPU prefix "
                "cache; a later prefix hit loads them back instead of recomputing (0: off)"})
    # NIXL KV transport (issue 22)
    kv_transport: str = field(default="tcp", metadata={"choices": KV_TRANSPORTS,
        "help": "how KV blocks move between prefill and decode engines: tcp (BLOCK frames "
                "through host memory), or nixl (NIXL READs of the prefill engine's registered "
                "caches, needs the engine's `nixl` extra on both sides; a pull falls back to "
                "tcp where nixl is missing or its READ fails, and /metrics says which ran)"})

    # all-reduce of tensor parallelism (issue 16): vLLM's flag name
    disable_custom_all_reduce: bool = field(default=False, metadata={
        "help": "every tensor-parallel all-reduce over NCCL; by default messages up to "
                "--custom-all-reduce-max-bytes go over torch symmetric memory (one-/two-shot, "
                "peer-to-peer, no multicast) when the group is on one host with P2P (CUDA, "
                "2/4/8 ranks, bfloat16 or float32; start-up says which, and why not)"})
    custom_all_reduce_max_bytes: int = field(default=0, metadata={
        "help": "size of the symmetric all-reduce buffer, the largest message it takes "
                "(0: max_num_seqs x hidden_size x dtype bytes, one decode step, at most 8 MiB)"})
    # multi-LoRA serving (issue 24): vLLM's flags
    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (PEFT format) on q/k/v/o/gate/up/down beside the base "
                "model; a request's `model` names the adapter. One rank, unquantised, "
                "aggregated role, no speculative decoding or host KV tier"})
    lora_modules: list[str] | None = field(default=None, metadata={"nargs": "+",
        "help": "adapters loaded at start-up: name=path [name=path ...] (a PEFT dir with "
                "adapter_config.json and adapter_model.safetensors); more at run time with "
                "POST /v1/load_lora_adapter"})
    max_loras: int = field(default=1, metadata={
        "help": "adapters resident on the device at once (their slots); a request whose "
                "adapter has no slot waits until one frees"})
    max_lora_rank: int = field(default=16, metadata={
        "help": "largest adapter rank r accepted (sizes the slots)"})

    def __post_init__(self) -> None:
        for name, allowed in (("dtype", DTYPES), ("load_format", LOAD_FORMATS),
                              ("device", DEVICES), ("attention_backend", ATTENTION_BACKENDS),
                              ("scheduling_policy", SCHEDULING_POLICIES), ("role", ROLES),
                              ("async_scheduling", ASYNC_SCHEDULING),
                              ("structured_outputs_backend", STRUCTURED_OUTPUTS_BACKENDS),
                              ("quantization", QUANTIZATIONS),
                              ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("kv_transport", KV_TRANSPORTS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is invalid: choose one of {', '.join(allowed)}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} is invalid: "
                             "must be in (0, 1]")
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        if self.custom_all_reduce_max_bytes < 0:
            raise ValueError(f"custom_all_reduce_max_bytes={self.custom_all_reduce_max_bytes!r} "
                             "is invalid: must be >= 0 (0 sizes it to one decode step)")
        if self.kv_offload_gb < 0:
            raise ValueError(f"kv_offload_gb={self.kv_offload_gb!r} is invalid: must be >= 0 "
                             "(0 turns the host tier off)")
        self._check_speculative()
        self._check_lora()

    def _check_lora(self) -> None:
        from kvpilot.engine.contracts.lora import parse_lora_modules

        parse_lora_modules(self.lora_modules)
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be at least 1")
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError(f"lora_modules={self.lora_modules!r} needs enable_lora: add "
                                 "--enable-lora")
            return
        ranks = self.tensor_parallel_size * self.pipeline_parallel_size
        refused = (("tensor_parallel_size x pipeline_parallel_size", ranks, ranks > 1,
                    "run on one GPU"),
                   ("speculative_config", self.speculative_config,
                    self.speculative_config is not None, "drop --speculative-config"),
                   ("quantization", self.quantization, self.quantization != "none",
                    "use --quantization none"),
                   ("role", self.role, self.role != "both", "use --role both"),
                   ("kv_offload_gb", self.kv_offload_gb, self.kv_offload_gb > 0,
                    "use --kv-offload-gb 0"))
        for name, value, bad, fix in refused:
            if bad:
                raise ValueError(f"enable_lora does not work with {name}={value!r} yet: {fix}, "
                                 "or drop --enable-lora")

    def _check_speculative(self) -> None:
        from kvpilot.engine.contracts.speculative import parse_speculative_config

        if parse_speculative_config(self.speculative_config) is None:
            return
        if self.async_scheduling == "on":
            raise ValueError("async_scheduling='on' does not work with speculative_config yet: "
                             "use --async-scheduling auto or off (auto turns it off)")
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(f"speculative_config needs one rank, got tensor_parallel_size="
                             f"{self.tensor_parallel_size} x pipeline_parallel_size="
                             f"{self.pipeline_parallel_size}: drop --speculative-config or run "
                             "on one GPU")
        if self.role != "both":
            raise ValueError(f"speculative_config does not work with role={self.role!r}: "
                             "use it on an aggregated engine (--role both)")

    @property
    def name(self) -> str:
        """The model name clients send."""
        return self.served_model_name or self.model

    def to_cli(self) -> list[str]:
        """Gives the flags that reproduce these args, omitting defaults."""
        return _to_cli(self)


@dataclass
class ServerArgs:
    """Flags of the HTTP server around the engine."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_queue_len: int = field(default=1024, metadata={
        "help": "waiting requests beyond which new ones get 429"})
    drain_timeout: float = field(default=30.0, metadata={
        "help": "seconds in-flight requests get to finish after SIGTERM"})
    drain_handover_timeout: float = field(default=5.0, metadata={
        "help": "seconds after SIGTERM before streams a router can resume elsewhere (those "
                "it sent with x-kvpilot-resumable) end with a 503 event that has the router "
                "move them to another replica, so a pod leaves without waiting for its "
                "longest generation; others get --drain-timeout"})
    api_key: str | None = field(default=None, metadata={
        "help": f"require this bearer token on /v1/* (default: ${API_KEY_ENV}, if set)"})
    metrics_require_api_key: bool = field(default=False, metadata={
        "help": "require the API key on /metrics too (open by default, as vLLM's)"})
    chat_template: str | None = field(default=None, metadata={
        "help": "a Jinja chat template, or a file holding one, used instead of the model's"})
    log_level: str = "info"
    # tool calls (issue 24): vLLM's flags
    enable_auto_tool_choice: bool = field(default=False, metadata={
        "help": "let the model decide to call tools (tool_choice=auto); needs "
                "--tool-call-parser"})
    tool_call_parser: str | None = field(default=None, metadata={
        "choices": TOOL_CALL_PARSERS,
        "help": "how tool calls are written in this model's replies: hermes (Qwen, Hermes: "
                "<tool_call>{...}</tool_call>) or llama3_json (Llama 3.x JSON calls)"})
    api_server_count: int = field(default=1, metadata={
        "help": "API server processes (HTTP, tokenisation, detokenisation, SSE) sharing the "
                "port in front of the one engine core process; more than 1 when one "
                "process's Python is the limit"})
    max_request_bytes: int = field(default=0, metadata={
        "help": "largest request body taken; a larger one gets 413 before it is read. 0: "
                "sized from --max-model-len (the largest prompt as JSON escapes, or "
                "max-model-len token ids, plus 1 MiB)"})
    max_prompt_chars: int = field(default=0, metadata={
        "help": "longest prompt (characters of text, or of a chat's messages) tokenised; a "
                "longer one gets 400 before tokenising. 0: --max-model-len times the "
                "vocabulary's longest token, the most characters that can fit"})

    def __post_init__(self) -> None:
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count={self.api_server_count!r} is invalid: "
                             "must be at least 1")
        if self.drain_handover_timeout < 0:
            raise ValueError(f"drain_handover_timeout={self.drain_handover_timeout!r} is "
                             "invalid: must be >= 0 (0: hand streams over at once)")
        for name in ("max_request_bytes", "max_prompt_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be >= 0 "
                                 "(0: sized from --max-model-len)")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice=True needs tool_call_parser: pass "
                             f"--tool-call-parser ({' or '.join(TOOL_CALL_PARSERS)})")

    def to_cli(self) -> list[str]:
        return _to_cli(self)


def model_from_cli(positional: str | None, flag: str | None, command: str) -> str:
    """Gives the model a command line names, positionally (`kvpilot serve MODEL`, as vLLM) or
    with --model; raises ValueError naming the fix when it names none or two different ones."""
    if positional and flag and positional != flag:
        raise ValueError(f"model={positional!r} and --model={flag!r} disagree: give the model "
                         f"once, e.g. `kvpilot {command} {positional}`")
    model = positional or flag
    if not model:
        raise ValueError(f"no model given: `kvpilot {command} MODEL` takes a model directory "
                         "or a Hub id in the local Hugging Face cache; `kvpilot "
                         f"{command} tiny-llama` serves the built-in random-weight model")
    return model


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _to_cli(obj: Any) -> list[str]:
    out: list[str] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        default = f.default if f.default is not MISSING else None
        if value == default:
            continue
        if isinstance(value, bool):
            out.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, list):
            out += [_flag(f.name), *map(str, value)]
        elif value is not None:
            out += [_flag(f.name), str(value)]
    return out


def add_dataclass_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                       cls: type, skip: frozenset[str] = frozenset()) -> None:
    """Adds one flag per field of `cls` but those named in `skip` (bools get --x / --no-x)."""
    for f in fields(cls):
        if f.name in skip:
            continue
        meta = dict(f.metadata)
        default = f.default if f.default is not MISSING else None
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": meta.get("help")}
        if isinstance(default, bool):
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        type_name = str(f.type)
        if "int" in type_name and "str" not in type_name:
            kwargs["type"] = int
        elif "float" in type_name:
            kwargs["type"] = float
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        if "nargs" in meta:
            kwargs["nargs"] = meta["nargs"]
        parser.add_argument(_flag(f.name), **kwargs)


def from_namespace(cls: type[ArgsT], args: argparse.Namespace) -> ArgsT:
    """Builds `cls` from the parsed flags of `add_dataclass_args`."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
