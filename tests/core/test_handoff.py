"""KV hand-off seam: a prefill engine's blocks copied into a decode engine continue exactly."""

from __future__ import annotations

import pytest

from kvpilot.engine.args import EngineArgs
from kvpilot.engine.core.handoff import export_blocks, import_prefill, release
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.sampling_params import SamplingParams

PROMPT = list(range(100, 141))  # 2 full blocks + 9 tokens


def make_engine(**flags) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", num_kv_blocks=32, **flags))


def finish(engine: LLMEngine, request_id: str):
    for _ in range(100):
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out
    raise AssertionError("request did not finish")


@pytest.mark.parametrize("caching", [True, False])
def test_prefill_then_decode_elsewhere_equals_one_engine(caching):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    whole = make_engine()
    whole.add_request("r", PROMPT, greedy)
    expected = finish(whole, "r").outputs[0].token_ids

    prefill = make_engine(enable_prefix_caching=caching)
    prefill.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=1,
                                                    ignore_eos=True), hold_blocks=True)
    first = finish(prefill, "r").outputs[0].token_ids
    src_blocks, hashes = export_blocks(prefill, "r")
    assert len(src_blocks) == 3 and len(hashes) == 2
    assert first == expected[:1]

    decode = make_engine(enable_prefix_caching=caching)
    dst_blocks = import_prefill(decode, "r", PROMPT, first[0], greedy)
    assert len(dst_blocks) == 3
    for src_cache, dst_cache in zip(prefill.runner.kv_caches, decode.runner.kv_caches,
                                    strict=True):
        dst_cache[:, dst_blocks] = src_cache[:, src_blocks]
    release(prefill, "r")
    assert prefill.get_stats().num_free_blocks == 32
    assert finish(decode, "r").outputs[0].token_ids == expected
    assert decode.get_stats().num_free_blocks == 32
    assert decode.get_stats().prompt_tokens == 0  # nothing recomputed on the decode side


def test_export_needs_a_held_request():
    engine = make_engine()
    with pytest.raises(KeyError, match="hold_blocks=True"):
        export_blocks(engine, "missing")


def test_import_waits_for_room():
    engine = LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", num_kv_blocks=4))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert import_prefill(engine, "a", PROMPT, 5, params) is not None  # 3 of 4 blocks
    assert import_prefill(engine, "b", PROMPT, 5, params) is None
    assert "b" not in engine.requests
