"""spec.engine.speculative: validated like the rest, rendered into --speculative-config (which
the engine parses back to the same config), a pvc:// draft mounted, unsupported pools refused."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.speculative import SpeculativeConfig, parse_speculative_config
from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import DecodePoolSpec
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.engine_args import check_extra_args
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool

IM = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
      "metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 1}}


def model_spec(speculative: dict[str, Any], **extra: Any) -> InferenceModelSpec:
    return InferenceModelSpec.model_validate({
        "model": {"name": "chat", "source": "pvc://weights/llama-8b"},
        "engine": {"speculative": speculative}, **extra})


def engine_pod(spec: InferenceModelSpec) -> dict[str, Any]:
    """Gives the engine pod spec of the InferenceModel's decode pool."""
    objects = render_children(IM, spec, owned_pools(spec, "chat"), RenderConfig())
    stored = next(o for o in objects if o["kind"] == "DecodePool")
    resolved = resolve_pool(DecodePoolSpec.model_validate(stored["spec"]), spec)
    rendered = render_pool({**stored, "metadata": {**stored["metadata"], "uid": "p1"}},
                           resolved, RenderConfig())
    return next(o for o in rendered if o["kind"] == "Deployment")["spec"]["template"]["spec"]


def rendered_config(pod: dict[str, Any]) -> SpeculativeConfig | None:
    args = pod["containers"][0]["args"]
    if "--speculative-config" not in args:
        return None
    return parse_speculative_config(args[args.index("--speculative-config") + 1])


@pytest.mark.parametrize("speculative, expected", [
    ({"method": "ngram", "numSpeculativeTokens": 4},
     SpeculativeConfig("ngram", 4, prompt_lookup_max=4, prompt_lookup_min=2)),
    ({"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMin": 3, "promptLookupMax": 5},
     SpeculativeConfig("ngram", 3, prompt_lookup_max=5, prompt_lookup_min=3)),
    ({"method": "ngram", "numSpeculativeTokens": 3, "promptLookupMin": 6},
     SpeculativeConfig("ngram", 3, prompt_lookup_max=6, prompt_lookup_min=6)),
    ({"method": "draft", "numSpeculativeTokens": 5, "draftSource": "dummy:tiny-llama"},
     SpeculativeConfig("draft_model", 5, model="tiny-llama")),
    ({"method": "draft", "numSpeculativeTokens": 2, "draftSource": "pvc://drafts/llama-1b"},
     SpeculativeConfig("draft_model", 2, model="/models/draft/drafts/llama-1b")),
])
def test_speculative_renders_into_the_engine_flag(speculative, expected):
    pod = engine_pod(model_spec(speculative))
    config = rendered_config(pod)
    assert config == expected
    args = pod["containers"][0]["args"]
    EngineArgs(model="x", speculative_config=args[args.index("--speculative-config") + 1])


def test_a_pvc_draft_is_mounted_read_only_beside_the_target():
    pod = engine_pod(model_spec({"method": "draft", "numSpeculativeTokens": 2,
                                 "draftSource": "pvc://drafts/llama-1b"}))
    volume = next(v for v in pod["volumes"] if v["name"] == "draft-model")
    assert volume["persistentVolumeClaim"] == {"claimName": "drafts", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "draft-model")
    assert mount == {"name": "draft-model", "mountPath": "/models/draft/drafts",
                     "readOnly": True}


def test_without_speculative_nothing_is_rendered():
    spec = InferenceModelSpec.model_validate({"model": {"name": "chat",
                                                        "source": "dummy:tiny-llama"}})
    pod = engine_pod(spec)
    assert rendered_config(pod) is None
    assert all(v["name"] != "draft-model" for v in pod["volumes"])


@pytest.mark.parametrize("speculative, message", [
    ({"method": "draft", "numSpeculativeTokens": 2}, "method draft needs draftSource"),
    ({"method": "ngram", "numSpeculativeTokens": 2, "draftSource": "dummy:tiny-llama"},
     "method ngram proposes from the context"),
    ({"method": "draft", "numSpeculativeTokens": 2, "draftSource": "dummy:tiny-llama",
      "promptLookupMax": 3}, "promptLookupMin/Max are for method ngram only"),
    ({"method": "ngram", "numSpeculativeTokens": 2, "promptLookupMin": 4, "promptLookupMax": 2},
     "promptLookupMin must not exceed promptLookupMax"),
    ({"method": "ngram", "numSpeculativeTokens": 0}, "greater than or equal to 1"),
    ({"method": "eagle", "numSpeculativeTokens": 2}, "'ngram' or 'draft'"),
    ({"method": "draft", "numSpeculativeTokens": 2, "draftSource": "hf://org/draft"},
     "should match pattern"),
])
def test_invalid_speculative_specs_are_refused(speculative, message):
    with pytest.raises(ValidationError, match=message):
        model_spec(speculative)


@pytest.mark.parametrize("extra, message", [
    ({"topology": {"tensorParallel": 2}}, "each replica spans 2 GPUs"),
    ({"servingMode": "disaggregated", "prefill": {"replicas": 1}}, "on a prefill pool"),
])
def test_pools_that_cannot_speculate_are_refused_naming_the_field(extra, message):
    spec = model_spec({"method": "ngram", "numSpeculativeTokens": 2}, **extra)
    with pytest.raises(ValueError, match=f"engine.speculative is set .*{message}"):
        for pool in owned_pools(spec, "chat"):
            resolve_pool(pool, spec)


def test_extra_args_cannot_set_the_flag_the_field_owns():
    with pytest.raises(ValueError, match=r"from spec\.engine\.speculative"):
        check_extra_args(["--speculative-config", '{"method": "ngram"}'])
