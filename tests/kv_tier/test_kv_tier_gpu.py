"""The host tier and a decode engine's landing pool on CUDA (pinned rows, copies on the
engine's stream, saves committed after their event): the same tokens as without them."""

from __future__ import annotations

import pytest
from helpers.engine_run import run
from kv_tier_helpers import BLOCK, PROMPT, evict, make_engine, prefill_then_pull

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.engine_loop.roles import attach_role
from kvpilot.operator.local.supervisor import free_port

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_gpu_evicted_prefix_is_restored_from_pinned_host_memory(async_scheduling):
    expected = run(make_engine(device="cuda"), "ref", PROMPT)[0]
    engine = make_engine(0.001, device="cuda", async_scheduling=async_scheduling)
    run(engine, "first", PROMPT)
    evict(engine, "x")
    before = engine.get_stats()
    tokens, final = run(engine, "again", PROMPT)
    assert tokens == expected
    assert engine.get_stats().kv_offload_loaded_blocks - before.kv_offload_loaded_blocks == 6
    assert final.num_cached_tokens == 6 * BLOCK


def test_gpu_decode_engine_loads_pulled_kv_before_its_step():
    def role(name: str):
        args = EngineArgs(model="tiny-llama", num_kv_blocks=64, block_size=BLOCK, role=name,
                          kv_transfer_port=free_port(), dtype="float32", device="cuda")
        return attach_role(LLMEngine.from_engine_args(args), "127.0.0.1", 0)

    expected = run(make_engine(device="cuda"), "agg", PROMPT)[0]
    prefill, decode = role("prefill"), role("decode")
    try:
        done = prefill_then_pull(prefill, decode, PROMPT, 10)
        assert done["imported"] == 7  # 6 full blocks and the tail
        tokens, final = run(decode, "dec", PROMPT)
        assert tokens == expected and final.num_cached_tokens == len(PROMPT) - 1
    finally:
        prefill.shutdown()
        decode.shutdown()
