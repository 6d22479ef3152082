"""Router command-line flags: the contract the operator renders into the router Deployment.

Torch-free and dependency-light on purpose: the operator imports `RouterArgs` to
build the exact `kvpilot route` command line a router pod runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.contracts.args import (
    API_KEY_ENV,
    FLEET_SECRET_HELP,
    KV_PORT_OFFSET,
    ROLES,
    _to_cli,
)
from kvpilot.engine.contracts.router_objectives import (
    FAIRNESS_ID_HEADER,
    OBJECTIVE_HEADER,
    SLO_TTFT_HEADER,
    parse_objectives,
)

POLICIES = ("round-robin", "least-load", "prefix-aware", "predicted-latency")
SLO_UNMEETABLE = ("queue", "shed")
DISCOVERIES = ("static", "kubernetes")

# Labels the router reads on EndpointSlices (copied there from the pool's Service):
# which pool role the endpoints serve. The operator renders them on each pool Service.
ROLE_LABEL = "kvpilot.dev/role"
# Header a client may send to pin a request to one instance URL (debugging, tests).
INSTANCE_HEADER = "x-kvpilot-instance"
# Header the router adds to every response: which instance(s) served the request.
SERVED_BY_HEADER = "x-kvpilot-served-by"
# the id a router gives the engine request (and its response) of a disaggregated request's
# decode leg: the prefill's response id, which the router streamed the first token under;
# never taken from a client (not in PASSED_HEADERS)
REQUEST_ID_HEADER = "x-kvpilot-request-id"
# the router asks an engine to mark each streamed event with the output token ids it
# carries (an SSE comment line, `: token_ids 1 2 3`, which the router strips), so that it
# can resume the stream on another engine (`resume`), and to hand the stream over on drain
RESUMABLE_HEADER = "x-kvpilot-resumable"
TOKEN_IDS_MARK = b": token_ids"


@dataclass
class RouterArgs:
    """Flags of `kvpilot route`; each field is a `--kebab-case` flag."""

    host: str = "127.0.0.1"
    port: int = 8080
    discovery: str = field(default="static", metadata={"choices": DISCOVERIES,
        "help": "static: --instances; kubernetes: EndpointSlices matching --selector"})
    instances: str | None = field(default=None, metadata={
        "help": "comma-separated engine URLs, each optionally prefixed by its role, e.g. "
                "http://127.0.0.1:8001,prefill=http://127.0.0.1:8002,decode=http://127.0.0.1:8003"})
    instances_file: str | None = field(default=None, metadata={
        "help": "static discovery from a file re-read every --refresh-interval: the same "
                "items as --instances, separated by commas or newlines (kvpilot up rewrites "
                "it to scale); an unreadable file keeps the last list"})
    namespace: str = field(default="default", metadata={
        "help": "namespace of the EndpointSlices (kubernetes discovery)"})
    selector: str | None = field(default=None, metadata={
        "help": "label selector of the pools' EndpointSlices, e.g. kvpilot.dev/model=llama"})
    port_name: str = field(default="http", metadata={
        "help": "EndpointSlice port name of the engines' HTTP port"})
    refresh_interval: float = field(default=2.0, metadata={
        "help": "seconds between discovery refreshes and /metrics scrapes"})
    policy: str = field(default="prefix-aware", metadata={"choices": POLICIES, "help":
        "predicted-latency: the replica with the lowest predicted TTFT that meets the "
        "request's objectives (one model of the pool learnt from served requests, times a "
        "speed per replica; prefix-aware until the model has --latency-min-samples and each "
        "candidate has served one)"})
    latency_min_samples: int = field(default=20, metadata={
        "help": "predicted-latency: streamed requests the pool's model learns from before "
                "placement trusts it"})
    flow_control: bool = field(default=False, metadata={
        "help": "hold requests in per-flow queues while every replica is saturated, dispatch "
                f"by priority band and fairly across flows ({FAIRNESS_ID_HEADER}, else the API "
                "key's tenant), shed with 429 + Retry-After from the lowest band first; each "
                "request goes with its engine priority (band, quiet flows first) as the body's "
                "priority, for engines under --scheduling-policy priority"})
    saturation_queue_depth: int = field(default=2, metadata={
        "help": "flow control: a replica that does not export kvpilot_max_num_seqs is "
                "saturated once its engine queue (scraped vllm:num_requests_waiting plus what "
                "the router sent it since) reaches this; one that does, once its requests fill "
                "its slots"})
    saturation_kv_usage: float = field(default=0.95, metadata={
        "help": "flow control: ... or its scraped vllm:kv_cache_usage_perc reaches this"})
    reserved_slots_fraction: float = field(default=0.125, metadata={
        "help": "flow control: of the pool's slots (its engines' kvpilot_max_num_seqs), the "
                "fraction whose last free ones go only to flows sending under their fair "
                "share of their band's rate (arrivals of the last 10 s over their span), so "
                "a quiet flow finds a free slot under a flood; 0: none kept"})
    max_queued_per_flow: int = field(default=64, metadata={
        "help": "flow control: requests one flow may have queued in one band; more are shed"})
    max_queued_requests: int = field(default=1024, metadata={
        "help": "flow control: requests queued in all; a fuller queue sheds the lowest band's "
                "newest request (or the arriving one when none is lower)"})
    queue_timeout: float = field(default=30.0, metadata={
        "help": "flow control: seconds a request may wait queued before a 429"})
    objectives: str | None = field(default=None, metadata={
        "help": "JSON list of objectives [{\"name\", \"priority\", \"models\", \"ttftMs\", "
                f"\"tpotMs\"}}]: a request's band is the objective {OBJECTIVE_HEADER} names, "
                "else the one whose models list its model or adapter, else 0"})
    slo_unmeetable: str = field(default="queue", metadata={"choices": SLO_UNMEETABLE, "help":
        f"flow control with predicted-latency: a request whose objective ({SLO_TTFT_HEADER}, "
        "or its objective's) no replica is predicted to meet waits queued until one does, "
        "or is shed at once"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "tokenizer dir or built-in model name, so prompt block hashes equal the "
                "engines' (default: hash the prompt's UTF-8 bytes)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block (the engines')"})
    prefix_index_max_entries: int = field(default=1_000_000, metadata={
        "help": "hard cap on (instance, block) entries of the prefix index (about 256 bytes "
                "each); least recently used entries go first"})
    load_weight: float = field(default=0.5, metadata={
        "help": "prefix-aware: how much relative load (waiting + in flight) costs"})
    kv_usage_weight: float = field(default=0.25, metadata={
        "help": "prefix-aware: how much KV-cache usage (0..1) costs"})
    cache_weight: float = field(default=0.05, metadata={
        "help": "prefix-aware: how much the blocks an instance already caches cost (sends "
                "new prefixes to the instance that caches the least)"})
    lora_affinity_margin: float = field(default=8.0, metadata={
        "help": "LoRA: a request for an adapter goes to the replicas holding it (vLLM's "
                "lora_requests_info) unless the least-loaded holder has more than this many "
                "requests (waiting + in flight) beyond the least-loaded other replica; then to "
                "a replica with a free adapter slot"})
    request_timeout: float = field(default=600.0, metadata={
        "help": "seconds a whole request may take"})
    connect_timeout: float = field(default=2.0, metadata={
        "help": "seconds to connect to an engine before trying another"})
    idle_timeout: float = field(default=60.0, metadata={
        "help": "seconds without a byte from a streaming engine before it counts as failed"})
    stall_timeout: float = field(default=4.0, metadata={
        "help": "seconds an instance may send nothing while the router waits for it (a "
                "request, or the health check sent every --refresh-interval) and others answer "
                "before it counts as stalled: out of rotation until it answers, its requests "
                "that sent the client nothing yet retried elsewhere; 0 disables"})
    max_retries: int = field(default=2, metadata={
        "help": "other instances tried when one fails before the first byte; when those "
                "failed too, the request holds (--hold-timeout) and gets up to as many tries "
                "again, on instances it has not failed on or that came back (at most 1 + 2x "
                "this in all)"})
    max_migrations: int = field(default=8, metadata={
        "help": "times one stream may move to another instance when its instance fails, "
                "stalls (--stall-timeout) or drains after the first byte: the new instance "
                "resumes it after the tokens the client has (same id, no token twice, usage "
                "once); 0 turns migration off"})
    eject_after_failures: int = field(default=3, metadata={
        "help": "consecutive failures that eject an instance"})
    eject_seconds: float = field(default=10.0, metadata={
        "help": "how long an instance stays ejected (doubles on repeat, at most 8x)"})
    hold_timeout: float = field(default=30.0, metadata={
        "help": "seconds a request waits for a ready instance (scale from zero) before 503, "
                "and, once every ready instance failed it before its first byte (or a "
                "stream's when it moves), for one to come back or appear before 502"})
    kv_port_offset: int = field(default=KV_PORT_OFFSET, metadata={
        "help": "disaggregated: an engine's KV agent listens on its HTTP port plus this "
                "(the engines' --kv-transfer-port 0 default)"})
    disagg_min_prompt_tokens: int = field(default=0, metadata={
        "help": "disaggregated: a prompt shorter than this (counted in full KV blocks of "
                "--block-size tokens) is prefilled by the decode instance itself, with no "
                "prefill hop and no KV transfer, as llm-d's P/D threshold; 0: every single "
                "prompt goes through a prefill instance"})
    transfer_timeout: float = field(default=10.0, metadata={
        "help": "disaggregated: seconds a KV pull may take before the decode side prefills "
                "locally"})
    api_key: str | None = field(default=None, metadata={
        "help": f"require this bearer token on /v1/* and send it to the engines (default: "
                f"${API_KEY_ENV}, if set)"})
    metrics_require_api_key: bool = field(default=False, metadata={
        "help": "require the API key on /metrics too (open by default)"})
    fleet_secret_file: str | None = field(default=None, metadata={"help": FLEET_SECRET_HELP})
    response_store_max_entries: int = field(default=10_000, metadata={
        "help": "Responses API: responses kept for previous_response_id (per API key), the "
                "least recently used leaving first"})
    response_store_ttl: float = field(default=3600.0, metadata={
        "help": "Responses API: seconds a stored response stays usable"})
    response_store_peers: str | None = field(default=None, metadata={
        "help": "Responses API: comma-separated URLs of the other router replicas, asked "
                "(fleet-signed) for a previous_response_id this one does not hold"})
    max_request_bytes: int = field(default=64 * 2**20, metadata={
        "help": "largest request body the router reads; a larger one gets 413 unread (an "
                "engine's own limit, sized from its --max-model-len, is usually lower: its "
                "413 passes through)"})
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name, allowed in (("policy", POLICIES), ("discovery", DISCOVERIES),
                              ("slo_unmeetable", SLO_UNMEETABLE)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is invalid: choose one of {', '.join(allowed)}")
        if self.discovery == "static" and not (self.instances or self.instances_file):
            raise ValueError("instances=None is invalid with discovery=static: pass "
                             "--instances http://HOST:PORT[,...], --instances-file PATH "
                             "or --discovery kubernetes")
        if self.instances and self.instances_file:
            raise ValueError(f"instances_file={self.instances_file!r} is invalid together with "
                             "--instances: pass one of them")
        if self.discovery == "kubernetes" and not self.selector:
            raise ValueError("selector=None is invalid with discovery=kubernetes: pass "
                             "--selector LABEL=VALUE")
        for name in ("block_size", "prefix_index_max_entries", "eject_after_failures",
                     "response_store_max_entries",
                     "max_request_bytes", "latency_min_samples", "saturation_queue_depth",
                     "max_queued_per_flow", "max_queued_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be at least 1")
        if self.lora_affinity_margin < 0:
            raise ValueError(f"lora_affinity_margin={self.lora_affinity_margin!r} is invalid: "
                             "must be >= 0 (0: leave a holder once it is busier at all)")
        if self.disagg_min_prompt_tokens < 0:
            raise ValueError(f"disagg_min_prompt_tokens={self.disagg_min_prompt_tokens!r} is "
                             "invalid: must be >= 0 (0: disaggregate every prompt)")
        if self.max_queued_per_flow > self.max_queued_requests:
            raise ValueError(f"max_queued_per_flow={self.max_queued_per_flow} is invalid: must "
                             f"be at most max_queued_requests={self.max_queued_requests}")
        if not 0 <= self.reserved_slots_fraction < 1:
            raise ValueError(f"reserved_slots_fraction={self.reserved_slots_fraction!r} is "
                             "invalid: must be in [0, 1) (0: no slot kept for quiet flows)")
        if not 0 < self.saturation_kv_usage <= 1:
            raise ValueError(f"saturation_kv_usage={self.saturation_kv_usage!r} is invalid: "
                             "must be in (0, 1]")
        if not self.queue_timeout > 0:
            raise ValueError(f"queue_timeout={self.queue_timeout!r} is invalid: must be > 0")
        if self.objectives is not None:
            parse_objectives(self.objectives)
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries!r} is invalid: must be >= 0")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations={self.max_migrations!r} is invalid: must be >= 0 "
                             "(0 turns migration off)")
        if self.instances:
            parse_instances(self.instances)
        if self.response_store_peers:
            parse_peers(self.response_store_peers)
        if self.response_store_ttl <= 0:
            raise ValueError(f"response_store_ttl={self.response_store_ttl!r} is invalid: "
                             "must be > 0")

    def to_cli(self) -> list[str]:
        """Gives the flags that reproduce these args, omitting defaults."""
        return _to_cli(self)


def parse_instances(text: str, allow_empty: bool = False) -> list[tuple[str, str]]:
    """Gives (role, url) pairs from 'URL' or 'ROLE=URL' items separated by commas or newlines.

    `allow_empty` accepts a text naming no instance (an instances file of a pool at zero).
    """
    out: list[tuple[str, str]] = []
    for item in (part.strip() for part in text.replace("\n", ",").split(",")):
        if not item:
            continue
        role, sep, url = item.partition("=")
        if not sep:
            role, url = "both", item
        if role not in ROLES:
            raise ValueError(f"instances item {item!r} has role {role!r}: choose one of "
                             f"{', '.join(ROLES)} (write ROLE=URL)")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"instances item {item!r} is not an http(s) URL: "
                             "write e.g. http://127.0.0.1:8001")
        out.append((role, url.rstrip("/")))
    if not out and not allow_empty:
        raise ValueError(f"instances={text!r} names no instance: write e.g. http://127.0.0.1:8001")
    return out

def parse_peers(text: str | None) -> list[str]:
    """Gives the router URLs of --response-store-peers (comma-separated http(s) URLs)."""
    peers = [p.strip().rstrip("/") for p in (text or "").split(",") if p.strip()]
    for peer in peers:
        if not peer.startswith(("http://", "https://")):
            raise ValueError(f"response_store_peers item {peer!r} is not an http(s) URL: "
                             "write e.g. http://router-1:8080")
    return peers


# Request headers the router passes on to engines (the client's auth stays at the router).
PASSED_HEADERS = ("content-type", "x-request-id")
