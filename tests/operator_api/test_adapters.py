"""The operator's own checks of spec.adapters (the CEL twins are in tests/admission): each
refusal names the field, the value and the fix."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import DecodePoolSpec
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.status import describe_error

BASE = {"model": {"name": "chat", "source": "dummy:tiny-llama"}, "accelerator": {"vendor": "cpu"}}
SQL = {"name": "sql", "source": "hf://org/sql"}


def refusal(**spec: Any) -> str:
    with pytest.raises(ValidationError) as info:
        InferenceModelSpec.model_validate({**BASE, **spec})
    return describe_error(info.value)


@pytest.mark.parametrize(("spec", "expected"), [
    ({"adapters": [SQL, {"name": "law", "source": "hf://org/law"}, {**SQL, "source": "pvc://c/x"}]},
     "spec.adapters[2].name='sql' repeats: adapter names must be unique"),
    ({"adapters": [SQL, {"name": "chat", "source": "hf://org/x"}]},
     "spec.adapters[1].name='chat' equals spec.model.name: an adapter may not take"),
    ({"adapters": [SQL], "servingMode": "disaggregated", "prefill": {}},
     "spec.adapters with servingMode=disaggregated: adapters need servingMode aggregated"),
    ({"engine": {"maxLoras": 2}}, "spec.engine.maxLoras/maxLoraRank without spec.adapters"),
    ({"adapters": []}, "adapters: List should have at least 1 item"),
    ({"adapters": [{"name": "Sql", "source": "hf://org/sql"}]},
     "adapters.0.name: name='Sql': adapter names are lowercase letters, digits and '-'"),
    ({"adapters": [{"name": "sql", "source": "dummy:tiny-llama"}]},
     "adapters.0.source: source='dummy:tiny-llama' is not an adapter source: write hf://"),
    ({"adapters": [{"name": "sql", "source": "s3://bucket/sql"}]}, "is not an adapter source"),
    ({"adapters": [SQL], "engine": {"maxLoras": 33}}, "engine.maxLoras"),
], ids=["repeated", "model-name", "disaggregated", "max-loras-alone", "empty-list",
        "name-case", "dummy-source", "s3-source", "max-loras-over-bound"])
def test_refused_naming_the_field(spec: dict[str, Any], expected: str):
    assert expected in refusal(**spec)


def test_valid_adapters_resolve_onto_the_pool():
    spec = InferenceModelSpec.model_validate(
        {**BASE, "adapters": [SQL, {"name": "law", "source": "oci://r/law:1"}],
         "engine": {"maxLoras": 2, "maxLoraRank": 32}})
    pool = resolve_pool(DecodePoolSpec(model_ref="m"), spec)
    assert [a.name for a in pool.adapters] == ["sql", "law"]


def test_inline_pool_engine_may_not_size_adapter_slots():
    pool = DecodePoolSpec.model_validate({**BASE, "engine": {"maxLoras": 2}})
    with pytest.raises(ValueError, match=r"spec\.engine\.maxLoras/maxLoraRank without spec\.adapters"):
        resolve_pool(pool, None)
