"""Tiny float32 engines and a bounded run loop for the host-tier tests."""

from __future__ import annotations

from helpers.engine_run import run

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.kv_connector.host_pool import HostKVPool

BLOCK = 16
GPU_BLOCKS = 16
PROMPT = list(range(3, 3 + 6 * BLOCK + 5))  # 6 full blocks and a 5-token tail
# three prompts of 8 blocks: together they evict every block of PROMPT from a 16-block cache
FILLERS = [list(range(500 + i * 150, 500 + i * 150 + 8 * BLOCK)) for i in range(3)]


def make_engine(kv_offload_gb: float = 0.0, **overrides) -> LLMEngine:
    # float32: greedy tokens are compared exactly (a prefix hit and a recompute batch
    # differently; bf16 could flip a near-tie)
    args = EngineArgs(model="tiny-llama", num_kv_blocks=GPU_BLOCKS, block_size=BLOCK,
                      dtype="float32", kv_offload_gb=kv_offload_gb, **overrides)
    return LLMEngine.from_engine_args(args)




def evict(engine, name: str) -> None:
    """Runs the fillers: every block of PROMPT leaves the GPU prefix cache."""
    for index, filler in enumerate(FILLERS):
        run(engine, f"{name}-fill-{index}", filler)


def host_pool(engine: LLMEngine) -> HostKVPool:
    """Gives the engine's host-tier pool (it must have one)."""
    assert engine.connector is not None, "the engine has no host tier"
    return engine.connector.pool


def prefill_then_pull(prefill: LLMEngine, decode: LLMEngine, prompt: list[int],
                      timeout: float) -> dict:
    """Prefills `prompt` on the prefill engine (request "pre", one token), then has the decode
    engine pull its blocks; gives the pull's DONE reply."""
    import asyncio

    from kvpilot.engine.contracts.kv_client import request_pull
    from kvpilot.engine.contracts.sampling_params import SamplingParams

    prefill.add_request("pre", prompt, SamplingParams(temperature=0, max_tokens=1))
    for _ in range(50):
        if not prefill.has_unfinished_requests():
            break
        prefill.step()
    return asyncio.run(request_pull(("127.0.0.1", decode.connector.port),
                                    ("127.0.0.1", prefill.connector.port), "pre", timeout))
