"""CEL rules of the committed CRDs accept the valid fixtures and reject the invalid ones,
and the pydantic models (what `kvpilot up` and the operator use) agree on every case."""

from __future__ import annotations

from typing import Any

import pytest
from crd_eval import api_server_errors, cel_sites, load_crds, openapi
from pydantic import ValidationError

from kvpilot.operator.api import DecodePool, InferenceModel, PrefillPool

MODEL = {"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B"}
PYDANTIC = {"InferenceModel": InferenceModel, "PrefillPool": PrefillPool, "DecodePool": DecodePool}


def im(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": "m"}, "spec": {"model": MODEL, **spec}}


def pool(kind: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": kind, "metadata": {"name": "p"},
            "spec": spec}


def named(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return {**obj, "metadata": {"name": name}}


AMD = {"vendor": "amd", "model": "MI300X"}
EP2 = {"tensorParallel": 2, "expertParallel": 2}
AMD_ENV = "configure AMD's ROCm stack"
NVLS = "NVLS (communication.nvlsEnable, NCCL_NVLS_*) is NVLink SHARP"
EXPERTS = "declare model.numExperts"

# (case id, object, expected message fragment or None when the object is accepted)
CASES: list[tuple[str, dict[str, Any], str | None]] = [
    ("minimal", im(), None),
    ("cpu-aggregated", im(accelerator={"vendor": "cpu"}, decode={"replicas": 1}), None),
    ("disaggregated", im(servingMode="disaggregated", prefill={"replicas": 1}), None),
    ("disaggregated-no-prefill", im(servingMode="disaggregated"),
     "servingMode disaggregated needs spec.prefill"),
    ("aggregated-with-prefill", im(prefill={"replicas": 1}),
     "spec.prefill is only used when servingMode is disaggregated"),
    ("amd-cpx-nps4", im(accelerator={**AMD, "computePartition": "CPX", "memoryPartition": "NPS4",
                                     "resourceNaming": "mixed"}), None),
    ("amd-qpx-nps1", im(accelerator={**AMD, "computePartition": "QPX", "memoryPartition": "NPS1"}),
     None),
    ("amd-qpx-nps4", im(accelerator={**AMD, "computePartition": "QPX", "memoryPartition": "NPS4"}),
     "memoryPartition NPS4 needs computePartition CPX"),
    ("amd-spx-nps4", im(accelerator={**AMD, "computePartition": "SPX", "memoryPartition": "NPS4"}),
     "memoryPartition NPS4 needs computePartition CPX"),
    ("amd-nps4-alone", im(accelerator={**AMD, "memoryPartition": "NPS4"}),
     "memoryPartition NPS4 needs computePartition CPX"),
    ("nvidia-partition", im(accelerator={"vendor": "nvidia", "computePartition": "CPX"}),
     "computePartition is an AMD setting"),
    ("cpu-memory-partition", im(accelerator={"vendor": "cpu", "memoryPartition": "NPS1"}),
     "memoryPartition is an AMD setting"),
    ("mixed-without-partition", im(accelerator={**AMD, "resourceNaming": "mixed"}),
     "resourceNaming mixed names resources after the partition"),
    ("tp-fits-node", im(topology={"tensorParallel": 8}, accelerator={"gpusPerNode": 8}), None),
    ("tp-exceeds-node", im(topology={"tensorParallel": 16}, accelerator={"gpusPerNode": 8}),
     "topology.tensorParallel must fit one node"),
    ("inference-pool-aggregated",
     im(inferencePool={"endpointPicker": {"name": "epp", "port": 9002}}), None),
    ("inference-pool-disaggregated",
     im(inferencePool={"endpointPicker": {"name": "epp", "port": 9002}},
        servingMode="disaggregated", prefill={}),
     "inferencePool selects engines that serve whole requests"),
    ("budget-ok", im(topology={"tensorParallel": 4, "pipelineParallel": 2}, gpuBudget=8), None),
    ("budget-exceeded", im(topology={"tensorParallel": 4, "pipelineParallel": 4}, gpuBudget=8),
     "one replica needs tensorParallel*pipelineParallel GPUs, more than gpuBudget"),
    ("decode-override-over-budget",
     im(gpuBudget=4, decode={"topology": {"tensorParallel": 8}}),
     "decode.topology needs more GPUs per replica than gpuBudget"),
    ("prefill-override-over-budget",
     im(gpuBudget=2, servingMode="disaggregated",
        prefill={"topology": {"tensorParallel": 2, "pipelineParallel": 2}}),
     "prefill.topology needs more GPUs per replica than gpuBudget"),
    ("floor-fits-budget",
     im(gpuBudget=8, topology={"tensorParallel": 2}, servingMode="disaggregated",
        prefill={"replicas": 2},
        decode={"replicas": 5, "autoscaling": {"minReplicas": 2, "maxReplicas": 5}}),
     None),
    ("floor-over-budget",
     im(gpuBudget=8, topology={"tensorParallel": 2}, servingMode="disaggregated",
        prefill={"replicas": 2}, decode={"replicas": 3, "autoscaling": {"minReplicas": 3}}),
     "the pools at their floor (autoscaling.minReplicas, else replicas) need more GPUs"),
    ("fixed-replicas-over-budget", im(gpuBudget=4, decode={"replicas": 5}),
     "the pools at their floor"),
    ("scale-to-zero-floor", im(gpuBudget=1, decode={"replicas": 3, "autoscaling": {
        "minReplicas": 0, "maxReplicas": 3}}), None),
    ("autoscaling-ok", im(decode={"autoscaling": {"minReplicas": 1, "maxReplicas": 3}}), None),
    ("autoscaling-min-over-max", im(decode={"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}),
     "minReplicas must be at most maxReplicas"),
    ("pool-autoscaling-min-over-max",
     pool("DecodePool", modelRef="m", autoscaling={"minReplicas": 3, "maxReplicas": 1}),
     "minReplicas must be at most maxReplicas"),
    ("decode-pool-ref", pool("DecodePool", modelRef="m", replicas=2), None),
    ("decode-pool-inline", pool("DecodePool", model=MODEL, engine={"maxNumSeqs": 8}), None),
    ("prefill-pool-ref", pool("PrefillPool", modelRef="m"), None),
    ("pool-both-sources", pool("DecodePool", modelRef="m", model=MODEL),
     "set exactly one of spec.modelRef"),
    ("pool-no-source", pool("PrefillPool", replicas=1), "set exactly one of spec.modelRef"),
    ("pool-engine-with-ref", pool("DecodePool", modelRef="m", engine={"blockSize": 32}),
     "spec.engine goes with an inline spec.model"),
    ("hf-cache", im(model={**MODEL, "cache": {"size": "40Gi"}, "include": ["*.safetensors"],
                           "exclude": []}), None),
    ("pvc-cache", im(model={"name": "x", "source": "pvc://weights/x", "cache": {"size": "1Gi"}}),
     "cache holds a Hub download"),
    ("oci-include", im(model={"name": "x", "source": "oci://ghcr.io/a/b:1",
                              "include": ["*.safetensors"]}),
     "include and exclude filter a Hub download"),
    ("pool-dummy-exclude", pool("DecodePool", model={"name": "x", "source": "dummy:tiny-llama",
                                                     "exclude": ["x"]}),
     "include and exclude filter a Hub download"),
    ("pool-tp-exceeds-node",
     pool("DecodePool", modelRef="m", topology={"tensorParallel": 16},
          accelerator={"gpusPerNode": 8}), "topology.tensorParallel must fit one node"),
    ("name-dotted", named(im(), "chat.v1"), "metadata.name must be a DNS-1035 label"),
    ("name-leading-digit", named(im(), "1chat"), "metadata.name must be a DNS-1035 label"),
    ("name-at-limit", named(im(), "a" * 37), None),
    ("name-too-long", named(im(), "a" * 38), "metadata.name may have at most 37 characters"),
    ("pool-name-at-limit", named(pool("DecodePool", modelRef="m"), "p" * 47), None),
    ("pool-name-too-long", named(pool("DecodePool", modelRef="m"), "p" * 48),
     "metadata.name may have at most 47 characters"),
    ("amd-unknown-model", im(accelerator={"vendor": "amd", "model": "MI999"}),
     "not a known AMD model"),
    ("nvidia-unknown-model", im(accelerator={"model": "V100"}), "not a known NVIDIA model"),
    ("amd-unpartitionable", im(accelerator={"vendor": "amd", "model": "MI250X",
                                            "computePartition": "CPX"}), "cannot be partitioned"),
    ("cpx-12-gpus", im(accelerator={**AMD, "computePartition": "CPX", "gpusPerNode": 12}),
     "gpusPerNode must be a whole number of partitioned GPUs"),
    ("cpx-80-gpus", im(accelerator={**AMD, "computePartition": "CPX", "gpusPerNode": 80}),
     "gpusPerNode must be a whole number of partitioned GPUs"),
    ("cpx-16-gpus", im(accelerator={**AMD, "computePartition": "CPX", "gpusPerNode": 16}), None),
    ("kv-cache-zero", im(engine={"kvCacheMemory": "0"}), "kvCacheMemory must hold at least one"),
    ("kv-cache-zero-gib", im(engine={"kvCacheMemory": "0.00GiB"}),
     "kvCacheMemory must hold at least one"),
    ("kv-cache-half-gib", im(engine={"kvCacheMemory": "0.5GiB"}), None),
    ("rccl-on-nvidia", im(communication={"env": {"RCCL_MSCCL_ENABLE": "0"}}), AMD_ENV),
    ("hsa-in-decode-overrides", im(decode={"overrides": {"env": {"HSA_NO_SCRATCH_RECLAIM": "1"}}}),
     AMD_ENV),
    ("rccl-on-amd", im(accelerator=AMD, communication={"env": {"RCCL_MSCCL_ENABLE": "0"}}), None),
    ("nvls-on-amd", im(accelerator=AMD, communication={"nvlsEnable": True}), NVLS),
    ("nvls-env-on-cpu", im(accelerator={"vendor": "cpu"},
                           overrides={"env": {"NCCL_NVLS_ENABLE": "1"}}), NVLS),
    ("ep-on-dense", im(topology=EP2), EXPERTS),
    ("ep-on-dense-decode", im(decode={"topology": EP2}), EXPERTS),
    ("ep-on-moe", im(model={**MODEL, "numExperts": 8}, topology=EP2), None),
    ("pool-ep-on-dense", pool("DecodePool", model=MODEL, topology=EP2), EXPERTS),
    ("pool-rccl-on-nvidia", pool("DecodePool", modelRef="m", accelerator={"vendor": "nvidia"},
                                 communication={"env": {"RCCL_MSCCL_ENABLE": "0"}}), AMD_ENV),
    ("pool-nvls-on-cpu", pool("PrefillPool", modelRef="m", accelerator={"vendor": "cpu"},
                              communication={"nvlsEnable": False}), NVLS),
    ("replicas-below-autoscaling", im(decode={"replicas": 1, "autoscaling": {
        "minReplicas": 2, "maxReplicas": 4}}), "must lie within autoscaling.minReplicas"),
    ("peer-empty", im(router={"allowFrom": [{}]}), "a peer needs podSelector"),
    ("peer-ip-and-pods", im(router={"allowFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"},
                                                  "podSelector": {}}]}),
     "ipBlock cannot be combined"),
    ("peer-namespace", im(router={"allowFrom": [{"namespaceSelector": {
        "matchLabels": {"team": "a"}}}]}), None),
    ("spec-ngram", im(engine={"speculative": {"method": "ngram", "numSpeculativeTokens": 3,
                                              "promptLookupMax": 4}}), None),
    ("spec-draft", im(engine={"speculative": {"method": "draft", "numSpeculativeTokens": 3,
                                              "draftSource": "dummy:tiny-llama"}}), None),
    ("spec-draft-no-source", im(engine={"speculative": {"method": "draft",
                                                        "numSpeculativeTokens": 3}}),
     "method draft needs draftSource"),
    ("spec-ngram-with-source", pool("DecodePool", model=MODEL, engine={"speculative": {
        "method": "ngram", "numSpeculativeTokens": 3, "draftSource": "pvc://d/m"}}),
     "method ngram proposes from the context"),
    ("spec-lookup-on-draft", im(engine={"speculative": {
        "method": "draft", "numSpeculativeTokens": 3, "draftSource": "pvc://d/m",
        "promptLookupMin": 2}}), "promptLookupMin/Max are for method ngram only"),
    ("spec-lookup-order", im(engine={"speculative": {
        "method": "ngram", "numSpeculativeTokens": 3, "promptLookupMin": 5,
        "promptLookupMax": 2}}), "promptLookupMin must not exceed promptLookupMax"),
    ("adapters", im(adapters=[{"name": "sql", "source": "hf://org/sql"},
                              {"name": "law", "source": "pvc://loras/law"}],
                    engine={"maxLoras": 2, "maxLoraRank": 64}), None),
    ("adapter-named-as-model", im(adapters=[{"name": "llama", "source": "hf://org/a"}]),
     "an adapter may not take spec.model.name"),
    ("adapters-disaggregated", im(servingMode="disaggregated", prefill={"replicas": 1},
                                  adapters=[{"name": "sql", "source": "hf://org/a"}]),
     "adapters need servingMode aggregated"),
    ("max-loras-without-adapters", im(engine={"maxLoraRank": 8}),
     "engine.maxLoras/maxLoraRank need an InferenceModel's spec.adapters"),
    # router flow control and objectives (issue 46)
    ("flow-control-and-objectives", im(
        adapters=[{"name": "sql", "source": "hf://org/sql"}],
        router={"policy": "predicted-latency", "flowControl": {"maxQueuedPerFlow": 8},
                "objectives": [{"name": "premium", "priority": 10, "models": ["llama"],
                                "ttftMs": 500},
                               {"name": "batch", "priority": -1, "models": ["sql", "sql"]},
                               {"name": "interactive", "tpotMs": 50}]}), None),
    ("flow-per-flow-above-total", im(router={"flowControl": {"maxQueuedPerFlow": 9,
                                                             "maxQueuedRequests": 8}}),
     "maxQueuedPerFlow must be at most maxQueuedRequests"),
    ("objective-model-not-served", im(router={"objectives": [{"name": "a", "models": ["x"]}]}),
     "objectives' models must name spec.model.name or one of spec.adapters"),
    ("objective-model-twice", im(router={"objectives": [{"name": "a", "models": ["llama"]},
                                                        {"name": "b", "models": ["llama"]}]}),
     "a model or adapter runs under one objective"),
]


@pytest.fixture(scope="module")
def crds() -> dict[str, dict[str, Any]]:
    return load_crds()


@pytest.mark.parametrize(("obj", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_api_server_verdict(crds: dict[str, Any], obj: dict[str, Any], expected: str | None):
    errors = api_server_errors(crds[obj["kind"]], obj)
    if expected is None:
        assert errors == []
    else:
        assert any(expected in e for e in errors), errors


@pytest.mark.parametrize(("obj", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_pydantic_agrees_with_cel(obj: dict[str, Any], expected: str | None):
    model = PYDANTIC[obj["kind"]]
    if expected is None:
        model.model_validate(obj)
        return
    with pytest.raises(ValidationError) as err:
        model.model_validate(obj)
    assert expected in str(err.value)


@pytest.mark.parametrize(("obj", "expected"), [
    (im(topology={"tensorParallel": 0}), "spec.topology.tensorParallel: 0 is less than"),
    (im(servingMode="split"), "spec.servingMode: 'split' is not one of"),
    (im(model={"name": "x", "source": "s3://bucket/x"}), "spec.model.source: 's3://bucket/x' does"),
    (im(router={"policy": "random"}), "spec.router.policy: 'random' is not one of"),
    (im(model={**MODEL, "cache": {"size": "lots"}}), "spec.model.cache.size: 'lots' does"),
    (im(progressDeadlineSeconds=5), "spec.progressDeadlineSeconds: 5 is less than"),
    (im(engine={"gpuMemoryUtilization": 0}), "spec.engine.gpuMemoryUtilization: 0 is less than"),
    (im(adapters=[{"name": "sql", "source": "hf://o/a"}, {"name": "sql", "source": "hf://o/b"}]),
     "spec.adapters.1: Duplicate value: {'name': 'sql'}"),
    (im(adapters=[]), "spec.adapters: [] should be non-empty"),
    (im(router={"objectives": [{"name": "a"}, {"name": "a"}]}),
     "spec.router.objectives.1: Duplicate value: {'name': 'a'}"),
])
def test_schema_rejects_field_values(crds: dict[str, Any], obj: dict[str, Any], expected: str):
    errors = api_server_errors(crds[obj["kind"]], obj)
    assert any(e.startswith(expected) for e in errors), errors


def test_every_rule_is_exercised(crds: dict[str, Any]):
    """Each CEL message appears as the expected rejection of at least one case."""
    expected = {c[2] for c in CASES if c[2]}
    for crd in crds.values():
        for _, rules in cel_sites(openapi(crd)):
            for rule in rules:
                assert any(e in rule["message"] for e in expected), rule["message"]
