"""Tiny float32 engines and a bounded run loop for the host-tier tests."""

from __future__ import annotations

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.core.outputs import EngineCoreOutput
from kvpilot.engine.kv_connector.host_pool import HostKVPool
from kvpilot.engine.llm_engine import LLMEngine

BLOCK = 16
GPU_BLOCKS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(3, 3 + 6 * BLOCK + 5))  # 6 full blocks and a 5-token tail
# three prompts of 8 blocks: together they evict every block of PROMPT from a 16-block cache
FILLERS = [list(range(500 + i * 150, 500 + i * 150 + 8 * BLOCK)) for i in range(3)]


def make_engine(kv_offload_gb: float = 0.0, **overrides) -> LLMEngine:
    # float32: greedy tokens are compared exactly (a prefix hit and a recompute batch
    # differently; bf16 could flip a near-tie)
    args = EngineArgs(model="tiny-llama", num_kv_blocks=GPU_BLOCKS, block_size=BLOCK,
                      dtype="float32", kv_offload_gb=kv_offload_gb, **overrides)
    return LLMEngine.from_engine_args(args)


def run(engine, request_id: str, prompt: list[int]) -> tuple[list[int], EngineCoreOutput]:
    """Runs one request to its end; gives its output token ids and its last delta."""
    engine.add_request(request_id, prompt, GREEDY)
    tokens, final = [], None
    for _ in range(300):  # bounded: a stuck engine fails the test instead of hanging it
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            tokens += output.completions[0].token_ids
            if output.finished:
                final = output
    assert not engine.has_unfinished_requests() and final is not None
    return tokens, final


def evict(engine, name: str) -> None:
    """Runs the fillers: every block of PROMPT leaves the GPU prefix cache."""
    for index, filler in enumerate(FILLERS):
        run(engine, f"{name}-fill-{index}", filler)


def host_pool(engine: LLMEngine) -> HostKVPool:
    """Gives the engine's host-tier pool (it must have one)."""
    assert engine.connector is not None, "the engine has no host tier"
    return engine.connector.pool
