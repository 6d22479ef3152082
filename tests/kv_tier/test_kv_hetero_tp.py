"""Heterogeneous TP: a TP=1 prefill engine's KV pulled by a TP=2 decode engine (gloo on CPU)
is re-sharded by KV head on the way in, and the decode engine answers token for token as
the aggregated engine does, computing only the prompt's last token."""

from __future__ import annotations

import pytest
from helpers.engine_run import run
from kv_tier_helpers import BLOCK, make_engine, prefill_then_pull

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.engine_loop.roles import attach_role
from kvpilot.engine.parallel.config import ParallelConfigError
from kvpilot.operator.local.supervisor import free_port

PROMPT = [*range(60, 60 + 5 * BLOCK), 4, 5, 6, 7]  # 5 full blocks and a 4-token tail


def role_engine(role: str, tp: int = 1, **overrides):
    args = EngineArgs(model="tiny-llama", num_kv_blocks=64, block_size=BLOCK, role=role,
                      kv_transfer_port=free_port(), dtype="float32",
                      tensor_parallel_size=tp, **overrides)
    return attach_role(LLMEngine.from_engine_args(args), "127.0.0.1", 0)


def test_prefill_tp1_to_decode_tp2_equals_aggregated():
    expected = run(make_engine(), "agg", PROMPT)[0]
    prefill, decode = role_engine("prefill"), role_engine("decode", tp=2)
    try:
        done = prefill_then_pull(prefill, decode, PROMPT, 20)
        assert (done["imported"], done["skipped"]) == (6, 0)  # 5 full blocks and the tail
        before = decode.get_stats()
        tokens, final = run(decode, "dec", PROMPT)
        assert tokens == expected
        assert final.num_cached_tokens == len(PROMPT) - 1
        assert decode.get_stats().prompt_tokens - before.prompt_tokens == 1
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize(("role", "overrides", "match"), [
    ("prefill", {}, "--role prefill with --tensor-parallel-size=2 is not supported"),
    ("decode", {"kv_offload_gb": 0.001}, "--kv-offload-gb=0.001 with 2 ranks"),
])
def test_what_heterogeneous_tp_does_not_cover_is_refused(role, overrides, match):
    with pytest.raises(ParallelConfigError, match=match):
        role_engine(role, tp=2, **overrides)


@pytest.mark.parametrize(("topology", "base", "role", "message"), [
    ((2, 1, 1), "tiny-llama", "decode", None),  # re-sharded by KV head on the way in
    ((4, 1, 1), "tiny-llama", "decode", None),  # 2 KV heads over 4 ranks: replicated heads
    ((2, 1, 1), "tiny-llama", "prefill", "--role prefill with --tensor-parallel-size=2"),
    ((2, 1, 2), "tiny-mixtral", "decode", "--role decode with --expert-parallel-size=2"),
])
def test_decode_roles_at_tp_above_one_pass_validation(topology, base, role, message):
    from kvpilot.engine.contracts.builtin_models import BUILTIN_CONFIGS
    from kvpilot.engine.models.config import ModelConfig
    from kvpilot.engine.parallel.config import ParallelConfig, validate

    config = ModelConfig.from_hf(BUILTIN_CONFIGS[base])
    if message is None:
        validate(ParallelConfig(*topology), config, "cpu", 0, role)
    else:
        with pytest.raises(ParallelConfigError, match=message):
            validate(ParallelConfig(*topology), config, "cpu", 0, role)
