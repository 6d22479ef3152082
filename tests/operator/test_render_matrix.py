"""Every object the renderers produce validates against the official Kubernetes 1.34 schemas."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import SPEC_BY_KIND
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool

K8S_VERSION = "1.34"
LLAMA_70B = {"name": "llama", "source": "hf://meta-llama/Llama-3.1-70B-Instruct",
             "numAttentionHeads": 64, "numKeyValueHeads": 8, "numLayers": 80,
             "parameterCount": 70_000_000_000, "secretRef": {"name": "hf"}}


def render_all(spec: dict[str, Any], config: RenderConfig) -> list[dict[str, Any]]:
    """Gives the InferenceModel's children plus every object its pools render."""
    parsed = InferenceModelSpec.model_validate(spec)
    im = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
          "metadata": {"name": "m", "namespace": "ns", "uid": "uid-m", "generation": 1}}
    objects = render_children(im, parsed, owned_pools(parsed, "m"), config)
    for pool in [o for o in objects if o["kind"] in SPEC_BY_KIND]:
        pool = {**pool, "metadata": {**pool["metadata"], "uid": f"uid-{pool['kind']}"}}
        resolved = resolve_pool(SPEC_BY_KIND[pool["kind"]].model_validate(pool["spec"]), parsed)
        objects += render_pool(pool, resolved, config)
    return objects


def engine(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    """Gives the engine container of the first workload of a role."""
    for obj in objects:
        template = obj.get("spec", {}).get("template") or \
            obj.get("spec", {}).get("leaderWorkerTemplate", {}).get("workerTemplate")
        if template and template["metadata"]["labels"].get("kvpilot.dev/role") == role:
            return template["spec"]["containers"][0]
    raise AssertionError(f"no {role} workload")


def node_values(objects: list[dict[str, Any]], role: str) -> set[str]:
    """Gives the node-affinity label values the role's pods require."""
    for obj in objects:
        template = obj.get("spec", {}).get("template") or \
            obj.get("spec", {}).get("leaderWorkerTemplate", {}).get("workerTemplate")
        if template and template["metadata"]["labels"].get("kvpilot.dev/role") == role:
            terms = (template["spec"].get("affinity", {}).get("nodeAffinity", {})
                     .get("requiredDuringSchedulingIgnoredDuringExecution", {})
                     .get("nodeSelectorTerms", []))
            return {v for t in terms for e in t["matchExpressions"] for v in e["values"]}
    return set()


def amd(compute: str, memory: str, naming: str = "single", tp: int = 8) -> dict[str, Any]:
    return {"model": {"name": "m", "source": "dummy:tiny-llama"},
            "topology": {"tensorParallel": tp},
            "accelerator": {"vendor": "amd", "model": "MI300X", "computePartition": compute,
                            "memoryPartition": memory, "resourceNaming": naming}}


# (case id, spec, config, role checked, workload kinds, gpu resource, GPUs per pod,
#  node label values, env names that must be present)
CASES = [
    ("cpu-tiny-aggregated",
     {"model": {"name": "tiny", "source": "dummy:tiny-llama"}, "accelerator": {"vendor": "cpu"}},
     RenderConfig(), "both", {"Deployment"}, None, 0, set(), set()),
    ("nvidia-h100-tp4",
     {"model": LLAMA_70B, "topology": {"tensorParallel": 4},
      "accelerator": {"vendor": "nvidia", "model": "H100-80GB"},
      "communication": {"socketIfname": "eth0", "debug": "WARN"}},
     RenderConfig(), "both", {"Deployment"}, "nvidia.com/gpu", 4, {"NVIDIA-H100-80GB-HBM3"},
     {"NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "HF_TOKEN"}),
    ("nvidia-multinode-disaggregated",
     {"model": LLAMA_70B, "topology": {"tensorParallel": 8, "pipelineParallel": 2},
      "accelerator": {"vendor": "nvidia", "model": "H100-80GB"},
      "servingMode": "disaggregated", "prefill": {"replicas": 2},
      "communication": {"rdma": True, "ibHca": "mlx5_0", "ibGidIndex": 3}},
     RenderConfig(), "decode", {"Deployment", "StatefulSet"}, "nvidia.com/gpu", 8,
     {"NVIDIA-H100-80GB-HBM3"},
     {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK", "NCCL_IB_HCA"}),
    ("nvidia-multinode-lws",
     {"model": LLAMA_70B, "topology": {"tensorParallel": 8, "pipelineParallel": 2},
      "accelerator": {"vendor": "nvidia"}},
     RenderConfig(leader_worker_set=True), "both", {"Deployment", "LeaderWorkerSet"},
     "nvidia.com/gpu", 8, set(), {"MASTER_ADDR", "NODE_RANK", "NCCL_IB_DISABLE"}),
    ("amd-spx-nps1", amd("SPX", "NPS1"), RenderConfig(), "both", {"Deployment"},
     "amd.com/gpu", 8, {"spx_nps1"}, {"NCCL_MIN_NCHANNELS"}),
    ("amd-dpx-nps1-mixed", amd("DPX", "NPS1", "mixed"), RenderConfig(), "both",
     {"Deployment"}, "amd.com/dpx_nps1", 8, {"dpx_nps1"}, {"NCCL_MIN_NCHANNELS"}),
    ("amd-qpx-nps1", amd("QPX", "NPS1"), RenderConfig(), "both", {"Deployment"},
     "amd.com/gpu", 8, {"qpx_nps1"}, {"NCCL_MIN_NCHANNELS"}),
    ("amd-cpx-nps1-mixed", amd("CPX", "NPS1", "mixed"), RenderConfig(), "both",
     {"Deployment"}, "amd.com/cpx_nps1", 8, {"cpx_nps1"}, {"NCCL_MIN_NCHANNELS"}),
    ("amd-cpx-nps4-mixed-tp1", amd("CPX", "NPS4", "mixed", tp=1), RenderConfig(), "both",
     {"Deployment"}, "amd.com/cpx_nps4", 1, {"cpx_nps4"}, set()),
    ("amd-pvc-disaggregated",
     {"model": {"name": "m", "source": "pvc://weights/llama-8b"}, "servingMode": "disaggregated",
      "prefill": {"topology": {"tensorParallel": 1}}, "topology": {"tensorParallel": 2},
      "accelerator": {"vendor": "amd", "model": "MI300X"},
      "overrides": {"nodeSelector": {"pool": "gpu"}, "env": {"X": "1"},
                    "tolerations": [{"key": "team", "operator": "Equal", "value": "a"}],
                    "resources": {"requests": {"memory": "64Gi"}}}},
     RenderConfig(), "prefill", {"Deployment"}, "amd.com/gpu", 1, set(), {"X"}),
]


@pytest.mark.parametrize(("spec", "config", "role", "workloads", "resource", "gpus", "labels",
                          "env"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rendered_objects_validate_and_place(spec, config, role, workloads, resource, gpus,
                                             labels, env):
    objects = render_all(spec, config)
    for obj in objects:
        if obj["kind"] in SPEC_BY_KIND:
            SPEC_BY_KIND[obj["kind"]].model_validate(obj["spec"])  # our CRDs: our models
        elif obj["kind"] == "LeaderWorkerSet":
            # Not a built-in kind: validate its pod template as a core PodTemplate.
            template = obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": "t"}, "template": template},
                                         K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    kinds = {o["kind"] for o in objects} & {"Deployment", "StatefulSet", "LeaderWorkerSet"}
    assert kinds == workloads
    container = engine(objects, role)
    requests = container["resources"]["requests"]
    gpu_keys = {k for k in requests if k.startswith(("nvidia.com/", "amd.com/"))}
    assert gpu_keys == ({resource} if resource else set())
    if resource:
        assert requests[resource] == container["resources"]["limits"][resource] == str(gpus)
    values = node_values(objects, role)
    assert labels <= values and bool(labels) == bool(values)
    assert env <= {e["name"] for e in container["env"]}


@pytest.mark.parametrize(("rdma", "caps", "rdma_resource"), [
    (False, {"drop": ["ALL"]}, False),
    (True, {"drop": ["ALL"], "add": ["IPC_LOCK"]}, True),
])
def test_ipc_lock_and_rdma_device_only_with_rdma(rdma, caps, rdma_resource):
    spec = {"model": {"name": "m", "source": "dummy:tiny-llama"},
            "accelerator": {"vendor": "nvidia"}, "communication": {"rdma": rdma}}
    container = engine(render_all(spec, RenderConfig()), "both")
    assert container["securityContext"]["capabilities"] == caps
    assert ("rdma/rdma_shared_device_a" in container["resources"]["limits"]) is rdma_resource


def test_pod_has_restricted_security_probes_drain_and_scrape_annotations():
    config = RenderConfig(drain_timeout_seconds=45)
    objects = render_all({"model": {"name": "m", "source": "dummy:tiny-llama"},
                          "accelerator": {"vendor": "nvidia"}}, config)
    deployment = next(o for o in objects if o["kind"] == "Deployment"
                      and o["metadata"]["name"] == "m-decode")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["lifecycle"]["preStop"] == {"sleep": {"seconds": 5}}
    assert pod["spec"]["terminationGracePeriodSeconds"] > 45 + 5
    assert "--drain-timeout" in container["args"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert container["command"] == ["kvpilot", "serve"]
    assert container["args"][:2] == ["--model", "tiny-llama"]


@pytest.mark.parametrize(("spec", "message"), [
    ({"topology": {"tensorParallel": 3}}, "topology.tensorParallel=3 does not divide"),
    ({"topology": {"tensorParallel": 16}, "accelerator": {"vendor": "nvidia"}},
     "topology.tensorParallel=16 exceeds the 8 GPUs of one node"),
    ({"topology": {"pipelineParallel": 32}}, "topology.pipelineParallel=32 exceeds"),
])
def test_unplannable_specs_raise_naming_the_field(spec, message):
    full = {"model": {"name": "m", "source": "dummy:tiny-llama", "numAttentionHeads": 32,
                      "numKeyValueHeads": 8, "numLayers": 16},
            "accelerator": {"vendor": "cpu"}, **spec}
    with pytest.raises(ValueError, match=message):
        render_all(full, RenderConfig())
