"""Structured outputs on a GPU: outputs validate with async scheduling on (CUDA's default),
the bitmask moved to the device and applied there."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.entrypoints.llm import LLM

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
          "properties": {"id": {"type": "integer"},
                         "tags": {"type": "array", "maxItems": 4,
                                  "items": {"enum": ["a", "b", "c"]}}}}


@pytest.mark.gpu
def test_outputs_validate_on_cuda_beside_unconstrained_requests() -> None:
    llm = LLM("tiny-qwen3", device="cuda", max_num_seqs=32, kv_cache_memory="256MiB")
    assert llm.engine.async_scheduling
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured_outputs=
                                  StructuredOutputsParams(json=json.dumps(SCHEMA)))
                   for s in range(16)]
    plain = [SamplingParams(temperature=1.0, seed=s, max_tokens=32, ignore_eos=True)
             for s in range(16)]
    outs = llm.generate(["x y z"] * 32, constrained + plain)
    for out in outs[:16]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs[16:])


@pytest.mark.gpu
def test_constrained_decode_steps_stay_async_and_replay_cuda_graphs() -> None:
    """The mask is filled while the forward runs: constrained rows stay in flight between
    steps (no host wait per step) and pure decode steps replay the captured graphs."""
    llm = LLM("tiny-qwen3", device="cuda", max_num_seqs=16, kv_cache_memory="256MiB")
    engine = llm.engine
    for i in range(16):
        engine.add_request(str(i), [5, 6, 7, 8], SamplingParams(
            temperature=1.0, seed=i, max_tokens=300,
            structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA))))
    in_flight = steps = 0
    for _ in range(2000):  # bounded
        if not engine.has_unfinished_requests():
            break
        engine.step()
        steps += 1
        flight = engine.flights.inflight
        in_flight += flight is not None and any(s.request.grammar is not None
                                                for s in flight.seqs)
    assert not engine.has_unfinished_requests()
    stats = engine.get_stats()
    assert in_flight > steps // 2
    assert stats.graph_steps > stats.eager_steps
