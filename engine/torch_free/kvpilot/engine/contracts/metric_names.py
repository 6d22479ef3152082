"""Metric names the engine exports; one source for the server, router and operator.

Engine metrics carry the names the ecosystem already scrapes (vLLM's), so
existing dashboards, KEDA scalers and gateways work unchanged. kvpilot-only
metrics use the `kvpilot_` prefix. Every engine metric carries a `model_name`
label. (prometheus_client appends `_total` to counters when exposing them.)
"""

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
# the engine's --max-num-seqs (requests it runs at once): the router's flow control counts a
# replica's free slots against it
MAX_NUM_SEQS = "kvpilot_max_num_seqs"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
# An info gauge (always 1) whose labels carry the KV layout; Gateway API endpoint pickers read
# block_size for their prefix-cache scorer and num_gpu_blocks for its capacity.
CACHE_CONFIG_INFO = "vllm:cache_config_info"
BLOCK_SIZE_LABEL = "block_size"
NUM_GPU_BLOCKS_LABEL = "num_gpu_blocks"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
# vLLM's names for tokens a KV connector was asked about / held past the GPU prefix hit:
# here the host-memory tier and blocks pulled from a prefill engine (per tier: the GPU
# tier's are PREFIX_CACHE_*)
EXTERNAL_PREFIX_CACHE_QUERIES = "vllm:external_prefix_cache_queries"
EXTERNAL_PREFIX_CACHE_HITS = "vllm:external_prefix_cache_hits"
NUM_PREEMPTIONS = "vllm:num_preemptions"
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"
# speculative decoding (only exported by an engine with --speculative-config)
SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
POSITION_LABEL = "position"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
# per finished request, as vLLM's: its prompt and generated token counts
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
# vLLM's older name of the inter-token latency, still scraped by its dashboards: same samples
TIME_PER_OUTPUT_TOKEN = "vllm:time_per_output_token_seconds"

# per engine step, as vLLM's: the prompt tokens it computed plus the tokens it generated
ITERATION_TOKENS = "vllm:iteration_tokens_total"
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

NUM_WAITING_PROMPT_TOKENS = "kvpilot_num_waiting_prompt_tokens"
DRAINING = "kvpilot_draining"
# forwards by how they ran: a decode graph's replay (pure decode batches), piecewise graphs
# (mixed steps of up to 512 tokens) or eagerly; every eager step while others decode
# stretches their inter-token latency
MODEL_STEPS = "kvpilot_model_steps"
MODE_LABEL = "mode"
# the engine's step time (host wall clock of one engine step: schedule, launch, and the wait
# for the step before it under async scheduling) by the mode of its forward
ENGINE_STEP_SECONDS = "kvpilot_engine_step_seconds"
# seconds the engine took from its start to ready: loading, graphs and the warm-up (the
# autoscaler waits at least this long for the pods a scale-up started)
ENGINE_STARTUP_SECONDS = "kvpilot_engine_startup_seconds"
STEP_SECONDS_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.008, 0.01, 0.0125, 0.015,
                        0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 1.0)
# host-memory KV tier (--kv-offload-gb, a decode engine's landed KV): blocks by what happened
# to them (saved, loaded, failed checksum, dropped when full, evicted LRU), and its usage
KV_OFFLOAD_BLOCKS = "kvpilot_kv_offload_blocks"
OP_LABEL = "op"
KV_HOST_CACHE_USAGE_PERC = "kvpilot_kv_host_cache_usage_perc"
# a prefill/decode engine's KV transport (--kv-transport): 1 on the configured one that loaded,
# and its completed pulls by the transport that moved their blocks (nixl falls back to tcp)
KV_TRANSPORT_INFO = "kvpilot_kv_transport_info"
KV_PULLS = "kvpilot_kv_pulls"
TRANSPORT_LABEL = "transport"

MODEL_NAME_LABEL = "model_name"
FINISHED_REASON_LABEL = "finished_reason"

# LoRA (vLLM's info gauge, whose value is the time it was set): the router reads which
# adapters an engine runs and waits on from its labels
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
RUNNING_LORA_ADAPTERS_LABEL = "running_lora_adapters"  # comma-separated adapter names
WAITING_LORA_ADAPTERS_LABEL = "waiting_lora_adapters"
MAX_LORA_LABEL = "max_lora"  # str(--max-loras)

# The router's own metrics (`kvpilot route`); the autoscaler reads the pending
# gauge to scale a pool up from zero replicas.
ROUTER_REQUESTS = "kvpilot_router_requests"
ROUTER_RETRIES = "kvpilot_router_retries"
ROUTER_EJECTIONS = "kvpilot_router_ejections"
ROUTER_PREFIX_HIT_BLOCKS = "kvpilot_router_prefix_hit_blocks"
ROUTER_PROMPT_BLOCKS = "kvpilot_router_prompt_blocks"
ROUTER_LORA_REQUESTS = "kvpilot_router_lora_requests"  # by outcome: affinity, overloaded, no_holder
ROUTER_TRANSFERRED_BLOCKS = "kvpilot_router_transferred_blocks"
ROUTER_IN_FLIGHT = "kvpilot_router_in_flight_requests"
ROUTER_PENDING_REQUESTS = "kvpilot_router_pending_requests"
ROUTER_INSTANCES = "kvpilot_router_instances"
ROUTER_PREFIX_INDEX_ENTRIES = "kvpilot_router_prefix_index_entries"
ROUTER_TIME_TO_FIRST_BYTE = "kvpilot_router_time_to_first_byte_seconds"
# in-flight migration: streams moved to another replica mid-way, and the pause each cost
ROUTER_MIGRATIONS = "kvpilot_router_migrations"  # by reason and outcome: resumed, failed
ROUTER_MIGRATION_SECONDS = "kvpilot_router_migration_seconds"
# flow control (`kvpilot route --flow-control`), by flow (the fairness id; the first
# FLOW_LABELS_MAX flows seen get their own label, later ones share "other") and priority band
ROUTER_FLOW_QUEUED = "kvpilot_router_flow_queued_requests"
ROUTER_FLOW_QUEUE_TIME = "kvpilot_router_flow_queue_time_seconds"
ROUTER_FLOW_REQUESTS = "kvpilot_router_flow_requests"  # by outcome: dispatched, shed, timeout, ...
FLOW_LABEL = "flow"
PRIORITY_LABEL = "priority"
# predicted-latency placement: each replica's latency model, term by term, and SLO outcomes
ROUTER_LATENCY_MODEL_COEFFICIENT = "kvpilot_router_latency_model_coefficient"
ROUTER_LATENCY_MODEL_SAMPLES = "kvpilot_router_latency_model_samples"
ROUTER_LATENCY_MODEL_SPEED = "kvpilot_router_latency_model_speed"
ROUTER_SLO_REQUESTS = "kvpilot_router_slo_requests"  # by outcome: met, missed
