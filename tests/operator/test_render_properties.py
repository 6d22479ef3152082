"""Invariants of rendering over many valid specs (hypothesis)."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.names import MAX_NAME
from kvpilot.operator.api.pools import SPEC_BY_KIND
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool

WORKLOADS = {"Deployment", "StatefulSet", "LeaderWorkerSet"}

specs = st.fixed_dictionaries({
    "tp": st.sampled_from([1, 2, 4, 8]),
    "pp": st.sampled_from([1, 2, 4]),
    "vendor": st.sampled_from(["nvidia", "amd", "cpu"]),
    "replicas": st.integers(0, 3),
    "mode": st.sampled_from(["aggregated", "disaggregated"]),
    "lws": st.booleans(),
    # every name the InferenceModel's own rule admits (a longer one is refused at the API)
    "name": st.from_regex(rf"[a-z][a-z0-9-]{{0,{MAX_NAME['InferenceModel'] - 2}}}[a-z0-9]",
                          fullmatch=True),
})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs)
@example({"tp": 8, "pp": 4, "vendor": "nvidia", "replicas": 3, "mode": "disaggregated",
          "lws": False, "name": "a" * MAX_NAME["InferenceModel"]})  # the longest name allowed
def test_rendering_invariants(case):
    spec = InferenceModelSpec.model_validate({
        "model": {"name": case["name"], "source": "dummy:tiny-llama"},
        "topology": {"tensorParallel": case["tp"], "pipelineParallel": case["pp"]},
        "accelerator": {"vendor": case["vendor"]}, "servingMode": case["mode"],
        "prefill": {"replicas": case["replicas"]} if case["mode"] == "disaggregated" else None,
        "decode": {"replicas": case["replicas"]}})
    config = RenderConfig(leader_worker_set=case["lws"])
    im = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
          "metadata": {"name": case["name"], "namespace": "ns", "uid": "u", "generation": 1}}
    children = render_children(im, spec, owned_pools(spec, case["name"]), config)
    names = [(o["kind"], o["metadata"]["name"]) for o in children]
    assert len(names) == len(set(names))  # no two children collide
    for pool in [o for o in children if o["kind"] in SPEC_BY_KIND]:
        pool = {**pool, "metadata": {**pool["metadata"], "uid": "p"}}
        resolved = resolve_pool(SPEC_BY_KIND[pool["kind"]].model_validate(pool["spec"]), spec)
        objects = render_pool(pool, resolved, config)
        gpus_per_replica = 0
        for obj in objects:
            assert len(obj["metadata"]["name"]) <= 63
            assert obj["metadata"]["ownerReferences"][0]["uid"] == "p"
            if obj["kind"] not in WORKLOADS:
                continue
            template = obj["spec"].get("template") or \
                obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]
            selector = obj["spec"].get("selector", {}).get("matchLabels", {})
            assert selector.items() <= template["metadata"]["labels"].items()
            requests = template["spec"]["containers"][0]["resources"]["requests"]
            per_pod = sum(int(v) for k, v in requests.items()
                          if k.startswith(("nvidia.com/", "amd.com/")))
            pods = obj["spec"]["replicas"] if obj["kind"] == "StatefulSet" else \
                obj["spec"].get("leaderWorkerTemplate", {}).get("size", 1)
            gpus_per_replica = per_pod * pods
        workloads = [o for o in objects if o["kind"] in WORKLOADS]
        gpu = case["vendor"] != "cpu"
        if not gpu:
            assert gpus_per_replica == 0
        elif workloads:
            # Every GPU of a replica is requested exactly once, whatever the layout.
            assert gpus_per_replica == case["tp"] * case["pp"]
        multi_node = gpu and case["tp"] * case["pp"] > 8
        if multi_node and not case["lws"]:
            assert len(workloads) == resolved.replicas  # one StatefulSet per replica
        else:
            assert len(workloads) == 1
