"""KV transfer carries fp8 blocks: a decode engine pulling an fp8 prompt's blocks gives the
aggregated fp8 engine's greedy tokens, and a peer with another KV dtype is refused at
the handshake (its blocks have other byte sizes)."""

from __future__ import annotations

import asyncio

import pytest
from helpers.engine_run import run

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.kv_client import request_pull
from kvpilot.engine.contracts.kv_protocol import ProtocolError
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.engine_loop.roles import attach_role
from kvpilot.operator.local.supervisor import free_port

BLOCK, NUM_BLOCKS = 16, 64
PROMPT = [*range(3, 3 + 4 * BLOCK), *range(200, 230)]  # 5 full blocks and a tail




def agent(engine) -> tuple[str, int]:
    return ("127.0.0.1", engine.connector.port)


def make_engine(role: str, kv_cache_dtype: str):
    args = EngineArgs(model="tiny-llama", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, role=role,
                      kv_transfer_port=free_port(), dtype="float32",
                      kv_cache_dtype=kv_cache_dtype)
    return attach_role(LLMEngine.from_engine_args(args), "127.0.0.1", 0)


@pytest.fixture(scope="module")
def engines():
    made = {name: make_engine(role, kv) for name, role, kv in (
        ("both", "both", "fp8"), ("prefill", "prefill", "fp8"), ("decode", "decode", "fp8"),
        ("prefill_auto", "prefill", "auto"))}
    yield made
    for name in ("prefill", "decode", "prefill_auto"):
        made[name].shutdown()


def test_fp8_blocks_move_and_give_the_aggregated_tokens(engines):
    expected, _ = run(engines["both"], "agg", PROMPT)
    run(engines["prefill"], "pre", PROMPT, SamplingParams(temperature=0, max_tokens=1))
    done = asyncio.run(request_pull(agent(engines["decode"]), agent(engines["prefill"]), "pre",
                                    timeout=10))
    assert done["imported"] == 6
    tokens, final = run(engines["decode"], "dec", PROMPT)
    assert tokens == expected
    assert final.num_cached_tokens == len(PROMPT) - 1


def test_peer_with_another_kv_dtype_is_refused(engines):
    prompt = [*range(300, 300 + 3 * BLOCK), 5]
    run(engines["prefill_auto"], "pre-auto", prompt, SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(ProtocolError, match="a different model, dtype or block size"):
        asyncio.run(request_pull(agent(engines["decode"]), agent(engines["prefill_auto"]),
                                 "pre-auto", timeout=10))
