"""schemathesis against the server's own /openapi.json: no 5xx and no hang.

Generated bodies are sent unchanged except that valid `n` and token limits are
capped, so each case stays a few engine steps long; type and range errors in
those fields are still generated and must come back as 4xx.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode
from server_harness import MODEL, RunningCore, serve_in_thread, tiny_app

EXAMPLES = 15
CAPS = {"n": 2, "max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 4}


@pytest.fixture(scope="module")
def api_schema(core: RunningCore) -> Iterator[Any]:
    # A short context keeps length errors reachable by generated prompts: the API server
    # checks requests against the limits its core reported, here told 64 tokens.
    short = replace(core.handle, ready=replace(core.handle.ready, max_model_len=64))
    with serve_in_thread(tiny_app(replace(core, handle=short))) as running:
        yield schemathesis.openapi.from_url(f"{running.base_url}/openapi.json")


def _cap(body: Any) -> None:
    if not isinstance(body, dict):
        return
    model = body.get("model")
    if isinstance(model, str) and len(model) % 4 != 1:
        body["model"] = MODEL  # most cases reach generation instead of the 404
    for field, cap in CAPS.items():
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[field] = cap


def _operations(schema: Any) -> list[Any]:
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(api_schema: Any, mode: GenerationMode) -> None:
    operations = _operations(api_schema)
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                              "/v1/models", "/health", "/ready", "/metrics"}
    seen: list[int] = []

    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to break in a request without parameters

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            _cap(case.body)
            response = case.call(timeout=30)
            seen.append(response.status_code)
            assert response.status_code < 500, (case.body, response.text)
            if response.status_code >= 400 and case.path.startswith("/v1"):
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}

        check()
    assert len(seen) >= 2 * EXAMPLES
    if mode is GenerationMode.POSITIVE:
        assert 200 in seen, "some generated requests should reach the engine"
