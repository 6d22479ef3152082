"""Every invalid manifest of the table is refused: at admission (schema and CEL of the
committed CRDs) where the API server can know, else by the operator before it applies any
child; the operator refuses every one of them itself too (objects can predate a CRD)."""

from __future__ import annotations

from typing import Any

import pytest
from invalid_manifests import CATEGORIES, admission_refusal, operator_refusal

# Cases only the operator can refuse: map keys and quantity comparisons have no CEL rule
# with a bounded cost, extraArgs need the engine's parser, sizes need the model's shape,
# a pool's inherited sections are known only once resolved.
OPERATOR_ONLY = {
    "requests-above-limits/cpu", "requests-above-limits/memory-units",
    "requests-above-limits/decode-pool-override", "env-names/equals-sign",
    "env-names/leading-digit", "env-names/space", "env-names/prefill-override",
    "labels/key-leading-dash", "labels/annotation-key-space", "extra-args/unknown-flag",
    "extra-args/bad-value", "extra-args/bad-choice", "extra-args/owned-port",
    "extra-args/api-key-in-args", "extra-args/owned-block-size", "extra-args/positional-model",
    "kv-cache-memory/one-block",
    "kv-cache-memory/below-one-block", "kv-cache-memory/below-one-sequence",
    "model-shape-and-fit/tp-not-dividing-heads", "model-shape-and-fit/pp-beyond-layers",
    "model-shape-and-fit/weights-do-not-fit", "gpu-budget/pool-over-operator-limit",
    "adapters/pool-max-lora-rank",
    # Kubernetes objects in overrides: their schemas do not fit the InferenceModel CRD's
    # 64 KiB (three copies of overrides); the CRD keeps them free-form (decision 0101)
    "typed-overrides/node-affinity-string", "typed-overrides/node-selector-term-typo",
    "typed-overrides/anti-affinity-without-topology-key",
    "typed-overrides/preferred-weight-above-100", "typed-overrides/toleration-operator",
    "typed-overrides/pool-toleration-seconds",
    # what the operator derives is known once the pool is planned; unknown keys such as
    # overrides.command are pruned, not refused, by an API server without strict validation
    "owned-fields/gpus-below-topology", "owned-fields/gpu-on-cpu",
    "owned-fields/amd-gpu-on-nvidia", "owned-fields/pool-gpus", "owned-fields/command",
    "owned-fields/ports", "owned-fields/readiness-probe-path", "owned-fields/scrape-port",
    "owned-fields/rendezvous-env", "owned-fields/api-key-env", "owned-fields/selector-label",
    "owned-fields/node-selector-vs-accelerator-model",
    # CPU rules: a CEL twin would not fit the InferenceModel CRD's size budget
    "cross-sections/gpu-model-on-cpu", "cross-sections/gpus-per-node-on-cpu",
    "cross-sections/gpu-memory-on-cpu", "cross-sections/rdma-on-cpu",
    "cross-sections/pool-ib-hca-on-cpu", "cross-sections/fp8-weights-on-cpu",
}


def check(category: str) -> None:
    for case_id, manifest, fragment in CATEGORIES[category]:
        where = f"{category}/{case_id}"
        admission, operator = admission_refusal(manifest), operator_refusal(manifest)
        assert operator is not None, f"{where}: the operator would apply it"
        if where in OPERATOR_ONLY:
            assert admission is None, f"{where}: now refused at admission, update the table"
            assert fragment in operator, f"{where}: {operator}"
        else:
            assert admission is not None, f"{where}: admitted"
            assert fragment in admission, f"{where}: {admission}"


def test_names():
    check("names")


def test_quantities():
    check("quantities")


def test_requests_above_limits():
    check("requests-above-limits")


def test_env_names():
    check("env-names")


def test_labels():
    check("labels")


def test_replicas():
    check("replicas")


def test_vendor_consistency():
    check("vendor-consistency")


def test_expert_parallel_on_dense_models():
    check("expert-parallel-on-dense")


def test_extra_args():
    check("extra-args")


def test_kv_cache_memory():
    check("kv-cache-memory")


def test_unknown_dummy_model():
    check("unknown-dummy-model")


def test_model_shape_and_fit():
    check("model-shape-and-fit")


def test_gpu_budget():
    check("gpu-budget")


def test_adapters():
    check("adapters")


@pytest.mark.parametrize("manifest", [
    {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
     "metadata": {"name": "a" * 37, "namespace": "default"},
     "spec": {"model": {"name": "x", "source": "dummy:tiny-llama"},
              "accelerator": {"vendor": "cpu"}, "engine": {"kvCacheMemory": "4MiB",
                                                           "extraArgs": ["--seed", "3"]},
              "overrides": {"env": {"MY_VAR": "1"}, "labels": {"example.com/team": "a-b"},
                            "resources": {"requests": {"cpu": "500m"},
                                          "limits": {"cpu": 1, "memory": "8Gi"}}}}},
], ids=["edges"])
def test_valid_edges_pass_both(manifest: dict[str, Any]):
    assert admission_refusal(manifest) is None
    assert operator_refusal(manifest) is None


def test_typed_overrides():
    check("typed-overrides")


def test_overrides_of_operator_owned_fields():
    check("owned-fields")


def test_cross_section_contradictions():
    check("cross-sections")
