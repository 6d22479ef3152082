"""Invalid manifests a user could plausibly write, by category (issue 18's table).

Each entry: (id, manifest, a fragment of the message that must refuse it). The manifests
are InferenceModels unless they say otherwise; `verdict` gives who refuses each one.
"""

from __future__ import annotations

import copy
from typing import Any

from crd_eval import api_server_errors, load_crds

from kvpilot.operator.api.pools import SPEC_BY_KIND
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.children import render_model
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool
from kvpilot.operator.status import describe_error

TINY = {"model": {"name": "tiny", "source": "dummy:tiny-llama"}, "accelerator": {"vendor": "cpu"}}
LLAMA = {"model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-70B-Instruct",
                   "numAttentionHeads": 64, "numKeyValueHeads": 8, "numLayers": 80,
                   "parameterCount": 70_000_000_000},
         "topology": {"tensorParallel": 8}, "accelerator": {"vendor": "nvidia",
                                                             "model": "H100-80GB"}}
AMD = {"vendor": "amd", "model": "MI300X"}


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Gives `base` with `extra` merged in, dicts recursively (a merge patch without nulls)."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and \
            isinstance(out.get(key), dict) else value
    return out


def im(name: str = "m", base: dict[str, Any] = TINY, **spec: Any) -> dict[str, Any]:
    """Gives an InferenceModel manifest: `base` with `spec` merged in."""
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": name, "namespace": "default"}, "spec": merge(base, spec)}


def pool(kind: str = "DecodePool", name: str = "p", **spec: Any) -> dict[str, Any]:
    """Gives a pool manifest with an inline tiny CPU model unless `spec` says otherwise."""
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": kind,
            "metadata": {"name": name, "namespace": "default"}, "spec": merge(TINY, spec)}


def overrides(**fields: Any) -> dict[str, Any]:
    return {"overrides": fields}


CATEGORIES: dict[str, list[tuple[str, dict[str, Any], str]]] = {
    "names": [
        ("64-characters", im("a" * 64), "metadata.name may have at most 37"),
        ("38-characters", im("a" * 38), "metadata.name may have at most 37"),
        ("dot", im("chat.v1"), "metadata.name must be a DNS-1035 label"),
        ("leading-digit", im("7b-chat"), "metadata.name must be a DNS-1035 label"),
        ("uppercase", im("Chat"), "metadata.name must be a DNS-1035 label"),
        ("pool-48-characters", pool(name="p" * 48), "metadata.name may have at most 47"),
    ],
    "quantities": [
        ("64GB", im(**overrides(resources={"requests": {"memory": "64GB"}})), "64GB"),
        ("negative-cpu-string", im(**overrides(resources={"requests": {"cpu": "-1"}})), "-1"),
        ("negative-cpu-int", im(**overrides(resources={"limits": {"cpu": -2}})), "-2"),
        ("space-before-unit", im(**overrides(resources={"limits": {"memory": "10 Gi"}})),
         "10 Gi"),
        ("two-dots", im(**overrides(resources={"requests": {"cpu": "1.5.5"}})), "1.5.5"),
    ],
    "requests-above-limits": [
        ("cpu", im(**overrides(resources={"requests": {"cpu": "4"}, "limits": {"cpu": "2"}})),
         "resources.requests.cpu=4 > resources.limits.cpu=2"),
        ("memory-units", im(**overrides(resources={"requests": {"memory": "64Gi"},
                                                   "limits": {"memory": "60G"}})),
         "resources.requests.memory=64Gi > resources.limits.memory=60G"),
        ("decode-pool-override", im(decode=overrides(resources={
            "requests": {"cpu": "1500m"}, "limits": {"cpu": 1}})),
         "resources.requests.cpu=1500m > resources.limits.cpu=1"),
    ],
    "env-names": [
        ("equals-sign", im(**overrides(env={"A=B": "1"})), "'A=B': env names"),
        ("leading-digit", im(**overrides(env={"1X": "1"})), "'1X': env names"),
        ("space", im(communication={"env": {"MY VAR": "1"}}), "'MY VAR': env names"),
        ("prefill-override", im(servingMode="disaggregated", prefill=overrides(
            env={"X=": "1"})), "'X=': env names"),
    ],
    "labels": [
        ("value-with-space", im(**overrides(labels={"team": "a b"})), "'a b' does not match"),
        ("value-64-characters", im(**overrides(labels={"team": "a" * 64})), "does not match"),
        ("key-leading-dash", im(**overrides(labels={"-team": "a"})), "keys are"),
        ("node-selector-value-slash", im(**overrides(nodeSelector={"zone": "eu/west"})),
         "'eu/west' does not match"),
        ("annotation-key-space", im(**overrides(annotations={"my note": "x"})), "keys are"),
    ],
    "replicas": [
        ("beyond-int32", im(decode={"replicas": 2**31}), "replicas"),
        ("beyond-maximum", im(decode={"replicas": 1001}), "replicas"),
        ("negative", im(decode={"replicas": -1}), "replicas"),
        ("above-max-replicas", im(decode={"replicas": 9, "autoscaling": {"maxReplicas": 8}}),
         "must lie within autoscaling.minReplicas"),
        ("below-min-replicas", im(decode={"replicas": 1, "autoscaling": {"minReplicas": 2}}),
         "must lie within autoscaling.minReplicas"),
        ("max-replicas-beyond-maximum", im(decode={"autoscaling": {"maxReplicas": 5000}}),
         "maxReplicas"),
        ("pool-100-million", pool(replicas=100_000_000, topology={"tensorParallel": 8,
                                                                  "pipelineParallel": 2},
                                  accelerator={"vendor": "nvidia"}), "replicas"),
    ],
    "vendor-consistency": [
        ("rccl-on-nvidia", im(base=LLAMA, communication={"env": {"RCCL_MSCCL_ENABLE": "0"}}),
         "configure AMD's ROCm stack"),
        ("hsa-on-cpu", im(**overrides(env={"HSA_NO_SCRATCH_RECLAIM": "1"})),
         "configure AMD's ROCm stack"),
        ("nvls-on-amd", im(accelerator=AMD, communication={"nvlsEnable": True}),
         "NVLink SHARP"),
        ("nvls-env-on-amd", im(accelerator=AMD, communication={"env": {
            "NCCL_NVLS_ENABLE": "1"}}), "NVLink SHARP"),
        ("unknown-amd-model", im(accelerator={"vendor": "amd", "model": "MI400X"}),
         "not a known AMD model"),
        ("unknown-nvidia-model", im(accelerator={"vendor": "nvidia", "model": "V100"}),
         "not a known NVIDIA model"),
        ("partition-on-mi210", im(accelerator={"vendor": "amd", "model": "MI210",
                                               "computePartition": "CPX"}),
         "cannot be partitioned"),
        ("cpx-with-12-gpus", im(accelerator={**AMD, "computePartition": "CPX",
                                             "gpusPerNode": 12}), "gpusPerNode must be"),
        ("dpx-with-20-gpus", im(accelerator={**AMD, "computePartition": "DPX",
                                             "gpusPerNode": 20}), "gpusPerNode must be"),
        ("pool-inherits-nvidia", pool(accelerator={"vendor": "nvidia"}, communication={
            "env": {"RCCL_MSCCL_ENABLE": "0"}}), "configure AMD's ROCm stack"),
    ],
    "expert-parallel-on-dense": [
        ("spec-topology", im(topology={"tensorParallel": 2, "expertParallel": 2}),
         "declare model.numExperts"),
        ("decode-topology", im(decode={"topology": {"tensorParallel": 2,
                                                    "expertParallel": 2}}),
         "declare model.numExperts"),
        ("pool", pool(topology={"tensorParallel": 2, "expertParallel": 2}),
         "declare model.numExperts"),
    ],
    "extra-args": [
        ("unknown-flag", im(engine={"extraArgs": ["--max-prompt-adapters", "8"]}),
         "unrecognized arguments: --max-prompt-adapters"),
        ("bad-value", im(engine={"extraArgs": ["--seed", "forty-two"]}),
         "invalid int value: 'forty-two'"),
        ("bad-choice", im(engine={"extraArgs": ["--attention-backend", "flash"]}),
         "invalid choice: 'flash'"),
        ("owned-port", im(engine={"extraArgs": ["--port=9000"]}),
         "sets --port, which the operator renders"),
        ("api-key-in-args", im(engine={"extraArgs": ["--api-key", "secret"]}),
         "sets --api-key, which the operator renders from spec.auth.apiKeySecretRef"),
        ("owned-block-size", im(engine={"extraArgs": ["--block-size", "0"]}),
         "sets --block-size, which the operator renders from spec.engine.blockSize"),
        ("positional-model", im(engine={"extraArgs": ["--seed", "3", "tiny-qwen3"]}),
         "names the model 'tiny-qwen3', which the operator renders from spec.model.source"),
    ],
    "kv-cache-memory": [
        ("zero", im(engine={"kvCacheMemory": "0"}), "kvCacheMemory must hold at least one"),
        ("zero-gib", im(engine={"kvCacheMemory": "0GiB"}), "kvCacheMemory must hold at least one"),
        ("one-block", im(engine={"kvCacheMemory": "16KiB"}), "holds 1 KV blocks"),
        ("below-one-block", im(engine={"kvCacheMemory": "1KiB"}), "holds 0 KV blocks"),
        ("below-one-sequence", im(engine={"kvCacheMemory": "1MiB"}),
         "one 4096-token sequence (engine.maxModelLen) needs 256"),
    ],
    "unknown-dummy-model": [
        ("tiny-gpt", im(model={"source": "dummy:tiny-gpt"}), "source"),
        ("llama", im(model={"source": "dummy:llama"}), "source"),
    ],
    "model-shape-and-fit": [
        ("tp-not-dividing-heads", im(base=LLAMA, topology={"tensorParallel": 3},
                                     accelerator={"gpusPerNode": 8}),
         "topology.tensorParallel=3 does not divide model.numAttentionHeads=64"),
        ("pp-beyond-layers", im(base={**LLAMA, "model": {**LLAMA["model"], "numLayers": 32}},
                                topology={"pipelineParallel": 48}),
         "topology.pipelineParallel=48 exceeds model.numLayers=32"),
        ("weights-do-not-fit", im(base=LLAMA, topology={"tensorParallel": 1}),
         "exceed 80.0 GB x 0.90 utilization"),
    ],
    "gpu-budget": [
        ("pool-over-operator-limit", pool(replicas=1000, topology={
            "tensorParallel": 8, "pipelineParallel": 2}, accelerator={"vendor": "nvidia"}),
         "16000 GPUs > 4096, the most the operator gives one pool"),
        ("model-over-gpu-budget", im(base=LLAMA, gpuBudget=16, decode={"replicas": 3}),
         "the pools at their floor"),
    ],
    "adapters": [
        ("name-not-dns", im(adapters=[{"name": "SQL_lora", "source": "hf://org/sql"}]),
         "adapters.0.name"),
        ("name-too-long", im(adapters=[{"name": "a" * 49, "source": "hf://org/sql"}]),
         "adapters.0.name"),
        ("dummy-source", im(adapters=[{"name": "sql", "source": "dummy:tiny-llama"}]),
         "adapters.0.source"),
        ("repeated-name", im(adapters=[{"name": "sql", "source": "hf://org/a"},
                                       {"name": "sql", "source": "hf://org/b"}]),
         "spec.adapters.1: Duplicate value"),
        ("model-name", im(adapters=[{"name": "tiny", "source": "hf://org/a"}]),
         "may not take spec.model.name"),
        ("too-many", im(adapters=[{"name": f"a{i}", "source": "hf://org/a"}
                                  for i in range(33)]), "adapters"),
        ("disaggregated", im(servingMode="disaggregated", prefill={},
                             adapters=[{"name": "sql", "source": "hf://org/a"}]),
         "adapters need servingMode aggregated"),
        ("max-loras-without-adapters", im(engine={"maxLoras": 2}),
         "engine.maxLoras/maxLoraRank need an InferenceModel's spec.adapters"),
        ("pool-max-lora-rank", pool(engine={"maxLoraRank": 8}),
         "engine.maxLoras/maxLoraRank need an InferenceModel's spec.adapters"),
    ],
    # Kubernetes objects embedded in overrides, checked against their core/v1 shapes
    "typed-overrides": [
        ("node-affinity-string", im(**overrides(affinity={"nodeAffinity": "gpu-nodes"})),
         "overrides.affinity.nodeAffinity: Input should be a valid dictionary"),
        ("node-selector-term-typo", im(**overrides(affinity={"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpression": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}})),
         "nodeSelectorTerms.0.matchExpression: Extra inputs are not permitted"),
        ("anti-affinity-without-topology-key", im(decode=overrides(affinity={
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "chat"}}}]}})),
         "requiredDuringSchedulingIgnoredDuringExecution.0.topologyKey: Field required"),
        ("preferred-weight-above-100", im(**overrides(affinity={"nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 500, "preference": {}}]}})),
         "preferredDuringSchedulingIgnoredDuringExecution.0.weight: Input should be less than "
         "or equal to 100"),
        ("toleration-operator", im(**overrides(tolerations=[{"key": "gpu",
                                                              "operator": "Exist"}])),
         "overrides.tolerations.0.operator: Input should be 'Exists' or 'Equal'"),
        ("toleration-not-an-object", im(**overrides(tolerations=["gpu"])),
         "spec.overrides.tolerations.0: 'gpu' is not of type 'object'"),
        ("pool-toleration-seconds", pool(overrides={"tolerations": [
            {"key": "k", "operator": "Exists", "effect": "NoSchedule",
             "tolerationSeconds": 30}]}), "tolerationSeconds applies to effect NoExecute"),
    ],
    # overrides of what the operator derives: both fields named
    "owned-fields": [
        ("gpus-below-topology", im(base=LLAMA, **overrides(resources={
            "limits": {"nvidia.com/gpu": 4}})),
         "overrides.resources.limits.nvidia.com/gpu=4 contradicts topology.tensorParallel=8"),
        ("gpu-on-cpu", im(**overrides(resources={"requests": {"nvidia.com/gpu": 1}})),
         "overrides.resources.requests.nvidia.com/gpu=1 with accelerator.vendor=cpu"),
        ("amd-gpu-on-nvidia", im(base=LLAMA, **overrides(resources={
            "limits": {"amd.com/gpu": 8}})),
         "overrides.resources.limits.amd.com/gpu with accelerator.vendor=nvidia"),
        ("pool-gpus", pool(topology={"tensorParallel": 2}, accelerator={"vendor": "nvidia"},
                           overrides={"resources": {"limits": {"nvidia.com/gpu": 1}}}),
         "overrides.resources.limits.nvidia.com/gpu=1 contradicts topology.tensorParallel=2"),
        ("command", im(**overrides(command=["python", "serve.py"])),
         "overrides.command contradicts the engine's command"),
        ("ports", im(decode=overrides(ports=[{"containerPort": 9000}])),
         "overrides.ports contradicts the engine's ports"),
        ("readiness-probe-path", pool(overrides={"readinessProbe": {
            "httpGet": {"path": "/healthz", "port": 8000}}}),
         "overrides.readinessProbe contradicts the engine's probes (GET /ready"),
        ("scrape-port", im(**overrides(annotations={"prometheus.io/port": "9000"})),
         "overrides.annotations.prometheus.io/port='9000' contradicts the engine's port"),
        ("rendezvous-env", im(**overrides(env={"MASTER_PORT": "1234"})),
         "overrides.env.MASTER_PORT is rendered by the operator from the multi-node rendezvous"),
        ("api-key-env", im(**overrides(env={"KVPILOT_API_KEY": "secret"})),
         "overrides.env.KVPILOT_API_KEY is rendered by the operator from auth.apiKeySecretRef"),
        ("selector-label", im(**overrides(labels={"kvpilot.dev/pool": "other"})),
         "overrides.labels.kvpilot.dev/pool is the operator's pod label"),
        ("node-selector-vs-accelerator-model", im(base=LLAMA, **overrides(nodeSelector={
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})),
         "overrides.nodeSelector.nvidia.com/gpu.product='NVIDIA-A100-SXM4-80GB' contradicts "
         "accelerator.model=H100-80GB"),
    ],
    # sections that contradict each other: vendor vs model, CPU vs GPU-only, partitions
    "cross-sections": [
        ("gpu-model-on-cpu", im(accelerator={"vendor": "cpu", "model": "H100-80GB"}),
         "accelerator.model=H100-80GB with accelerator.vendor=cpu"),
        ("amd-model-on-nvidia", im(accelerator={"vendor": "nvidia", "model": "MI300X"}),
         "not a known NVIDIA model"),
        ("gpus-per-node-on-cpu", im(accelerator={"vendor": "cpu", "gpusPerNode": 8}),
         "accelerator.gpusPerNode=8 with accelerator.vendor=cpu"),
        ("gpu-memory-on-cpu", im(engine={"gpuMemoryUtilization": 0.8}),
         "engine.gpuMemoryUtilization=0.8 with accelerator.vendor=cpu"),
        ("rdma-on-cpu", im(communication={"rdma": True}),
         "communication.rdma=True with accelerator.vendor=cpu"),
        ("pool-ib-hca-on-cpu", pool(communication={"ibHca": "mlx5_0"}),
         "communication.ibHca=mlx5_0 with accelerator.vendor=cpu"),
        ("fp8-weights-on-cpu", im(engine={"quantization": "fp8"}),
         "engine.quantization=fp8 with accelerator.vendor=cpu"),
        ("partition-on-nvidia", im(base=LLAMA, accelerator={"computePartition": "CPX"}),
         "computePartition is an AMD setting"),
        ("partition-on-cpu", im(accelerator={"vendor": "cpu", "memoryPartition": "NPS1"}),
         "memoryPartition is an AMD setting"),
    ],
}


def operator_refusal(manifest: dict[str, Any]) -> str | None:
    """Gives the operator's refusal of a stored object (what its handler checks before
    applying any child), or None when the operator would apply it."""
    config = RenderConfig()
    stored = {**manifest, "metadata": {**manifest["metadata"], "uid": "u"}}
    try:
        if manifest["kind"] == "InferenceModel":
            render_model(stored, manifest["spec"], config)
        else:
            parsed = SPEC_BY_KIND[manifest["kind"]].model_validate(manifest["spec"])
            render_pool(stored, resolve_pool(parsed, None), config)
    except ValueError as exc:
        return describe_error(exc)
    return None


def admission_refusal(manifest: dict[str, Any]) -> str | None:
    """Gives the API server's refusal (schema and CEL rules of the committed CRDs), or None."""
    errors = api_server_errors(load_crds()[manifest["kind"]], manifest)
    return "; ".join(errors) or None
