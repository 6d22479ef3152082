"""The longest names admission allows make only valid child names, at the most replicas and
with a weight cache; one character more would not (so the bound is the tight one)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.names import (
    DNS_1035,
    DNS_LABEL_MAX,
    MAX_NAME,
    MAX_REPLICAS,
    STATEFULSET_NAME_MAX,
    check_name,
    lws_group_name,
)
from kvpilot.operator.api.pools import SPEC_BY_KIND
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool

LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"


def everything(name: str) -> list[dict[str, Any]]:
    """Gives every object of a disaggregated two-node model with the most replicas."""
    spec = InferenceModelSpec.model_validate({
        "model": {"name": "x", "source": "hf://org/model", "cache": {"size": "40Gi"}},
        "topology": {"tensorParallel": 8, "pipelineParallel": 2},
        "accelerator": {"vendor": "nvidia"}, "servingMode": "disaggregated",
        "prefill": {"replicas": MAX_REPLICAS}, "decode": {"replicas": MAX_REPLICAS}})
    config = RenderConfig(max_pool_gpus=10**6)
    im = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
          "metadata": {"name": name, "namespace": "ns", "uid": "u", "generation": 1}}
    objects = render_children(im, spec, owned_pools(spec, name), config)
    for pool in [o for o in objects if o["kind"] in SPEC_BY_KIND]:
        stored = {**pool, "metadata": {**pool["metadata"], "uid": "p"}}
        resolved = resolve_pool(SPEC_BY_KIND[pool["kind"]].model_validate(pool["spec"]), spec)
        objects += render_pool(stored, resolved, config)
    return objects


def problems(objects: list[dict[str, Any]]) -> list[str]:
    out = []
    for obj in objects:
        name = obj["metadata"]["name"]
        limit = STATEFULSET_NAME_MAX if obj["kind"] == "StatefulSet" else 63
        if len(name) > limit or not re.search(DNS_1035, name):
            out.append(f"{obj['kind']} {name}")
        for value in obj["metadata"].get("labels", {}).values():
            if not re.search(LABEL_VALUE, value):
                out.append(f"label {value}")
        if obj["kind"] in SPEC_BY_KIND:  # the LeaderWorkerSet controller's group StatefulSets
            group = lws_group_name(name, MAX_REPLICAS - 1)
            if len(group) > STATEFULSET_NAME_MAX:
                out.append(f"LWS group {group}")
    return out


def test_the_longest_model_name_makes_valid_children():
    objects = everything("m" * MAX_NAME["InferenceModel"])
    assert len([o for o in objects if o["kind"] == "StatefulSet"]) == 2 * MAX_REPLICAS
    assert {o["kind"] for o in objects} >= {"PersistentVolumeClaim", "Job"}
    assert problems(objects) == []


def test_one_character_more_would_make_an_invalid_weights_job_name():
    name = "m" * (MAX_NAME["InferenceModel"] + 1)
    with pytest.raises(ValueError, match=r"metadata\.name"):
        check_name("InferenceModel", name)
    job = next(o for o in everything(name) if o["kind"] == "Job")  # rendered unchecked
    assert len(job["metadata"]["name"]) > DNS_LABEL_MAX
