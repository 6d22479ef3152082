"""Structured outputs on a GPU: outputs validate with async scheduling on (CUDA's default),
the bitmask moved to the device and applied there."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.contracts.structured_outputs import StructuredOutputsParams
from kvpilot.engine.llm import LLM

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
