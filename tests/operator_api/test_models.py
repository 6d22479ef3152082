"""The pydantic models: camelCase JSON, named errors, and agreement with the CRD."""

from __future__ import annotations

from typing import Any

import pytest
from crd_eval import api_server_errors, load_crds
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpilot.operator.api import (
    InferenceModel,
    InferenceModelSpec,
)

MODEL = {"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B"}


def test_json_is_camel_case_and_round_trips():
    spec = InferenceModelSpec.model_validate({
        "model": {**MODEL, "numKeyValueHeads": 8},
        "engine": {"maxNumSeqs": 16, "enablePrefixCaching": False},
        "topology": {"tensorParallel": 2},
        "servingMode": "disaggregated", "prefill": {"replicas": 2}, "gpuBudget": 8,
    })
    assert spec.model.num_key_value_heads == 8
    assert spec.engine.max_num_seqs == 16 and spec.engine.enable_prefix_caching is False
    data = spec.to_json()
    assert data["topology"] == {"tensorParallel": 2, "pipelineParallel": 1, "expertParallel": 1}
    assert data["prefill"] == {"replicas": 2} and data["gpuBudget"] == 8
    assert InferenceModelSpec.model_validate(data) == spec


@pytest.mark.parametrize(("spec", "fragment"), [
    ({"model": MODEL, "topology": {"tensorParalel": 2}}, "topology.tensorParalel\n  Extra inputs"),
    ({"model": {"name": "x", "source": "gs://b/x"}}, "model.source\n  String should match"),
    ({"model": MODEL, "decode": {"replicas": -1}}, "decode.replicas\n  Input should be greater"),
    ({"model": MODEL, "accelerator": {"vendor": "intel"}}, "accelerator.vendor\n  Input should be"),
])
def test_errors_name_the_field(spec: dict[str, Any], fragment: str):
    with pytest.raises(ValidationError) as err:
        InferenceModelSpec.model_validate(spec)
    assert fragment in str(err.value)


def test_object_ignores_server_fields():
    obj = InferenceModel.model_validate({
        "apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
        "metadata": {"name": "m", "generation": 2, "uid": "u"}, "spec": {"model": MODEL},
        "status": {"observedGeneration": 1, "decodeReplicas": "0/1"},
    })
    assert obj.metadata["generation"] == 2 and obj.status and obj.status.decode_replicas == "0/1"


CROSS_FIELD = st.fixed_dictionaries({
    "model": st.just(MODEL),
    "servingMode": st.sampled_from(["aggregated", "disaggregated"]),
    "topology": st.fixed_dictionaries({"tensorParallel": st.sampled_from([1, 2, 8, 16]),
                                       "pipelineParallel": st.sampled_from([1, 2, 4])}),
    "accelerator": st.fixed_dictionaries(
        {"vendor": st.sampled_from(["nvidia", "amd", "cpu"])},
        optional={"gpusPerNode": st.sampled_from([4, 8, 64]),
                  "computePartition": st.sampled_from(["SPX", "QPX", "CPX"]),
                  "memoryPartition": st.sampled_from(["NPS1", "NPS4"]),
                  "resourceNaming": st.sampled_from(["single", "mixed"])}),
    "decode": st.fixed_dictionaries({}, optional={
        "autoscaling": st.fixed_dictionaries({"minReplicas": st.integers(0, 4),
                                              "maxReplicas": st.integers(1, 4)}),
        "topology": st.fixed_dictionaries({"tensorParallel": st.sampled_from([1, 4, 8])})}),
}, optional={"prefill": st.just({"replicas": 1}), "gpuBudget": st.sampled_from([1, 8, 16])})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=CROSS_FIELD)
def test_pydantic_and_api_server_agree(spec: dict[str, Any]):
    """Every cross-field rule lives as CEL and as a validator: both give the same verdict
    (but the operator-only ones, which no CEL twin has: a CPU accelerator with a GPU count)."""
    accelerator = spec["accelerator"]
    assume(not (accelerator["vendor"] == "cpu" and "gpusPerNode" in accelerator))
    obj = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
           "metadata": {"name": "m"}, "spec": spec}
    server = api_server_errors(load_crds()["InferenceModel"], obj)
    try:
        InferenceModel.model_validate(obj)
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted == (server == []), server
