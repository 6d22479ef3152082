"""Resolving a pool once: sections filled from the InferenceModel, placement planned, hash kept."""

from __future__ import annotations

import pytest

from kvpilot.operator.api.common import TopologySpec
from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import AnyPoolSpec, DecodePoolSpec, PrefillPoolSpec
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.planning.topology import TopologyError
from kvpilot.operator.render.children import owned_pools, pool_specs
from kvpilot.operator.render.pool import spec_hash

MODEL = {"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B"}
OWNER = InferenceModelSpec.model_validate({
    "model": MODEL, "engine": {"blockSize": 32}, "topology": {"tensorParallel": 4},
    "accelerator": {"vendor": "amd", "model": "MI300X"}, "communication": {"debug": "INFO"},
    "servingMode": "disaggregated",
    "prefill": {"topology": {"tensorParallel": 2}}, "overrides": {"image": "img:1"},
})


@pytest.mark.parametrize(("pool", "role", "tp", "block_size", "vendor", "image", "gpus"), [
    (DecodePoolSpec(model_ref="m"), "both", 4, 32, "amd", "img:1", 4),
    (PrefillPoolSpec(model_ref="m"), "prefill", 2, 32, "amd", "img:1", 2),
    (DecodePoolSpec(model_ref="m", role="decode", topology=TopologySpec(tensor_parallel=8)),
     "decode", 8, 32, "amd", "img:1", 8),
    (DecodePoolSpec.model_validate({"model": MODEL, "engine": {"blockSize": 64},
                                    "accelerator": {"vendor": "cpu"}}),
     "both", 1, 64, "cpu", None, 0),
], ids=["decode-inherits", "prefill-uses-prefill-override", "own-topology-wins", "inline"])
def test_pool_resolution(pool: AnyPoolSpec, role: str, tp: int, block_size: int, vendor: str,
                         image: str | None, gpus: int):
    got = resolve_pool(pool, OWNER if pool.model_ref else None)
    assert (got.role, got.model.name, got.topology.tensor_parallel) == (role, "llama", tp)
    assert (got.engine.block_size, got.accelerator.vendor, got.overrides.image) == (
        block_size, vendor, image)
    assert got.placement.gpus_per_pod == gpus


def test_pool_resolution_without_owner_names_the_ref():
    with pytest.raises(ValueError, match=r"spec\.modelRef=.gone. names no InferenceModel"):
        resolve_pool(DecodePoolSpec(model_ref="gone"), None)


def test_resolution_plans_placement_and_names_the_field():
    pool = DecodePoolSpec.model_validate({
        "model": {**MODEL, "numAttentionHeads": 6}, "topology": {"tensorParallel": 4}})
    with pytest.raises(TopologyError, match=r"topology\.tensorParallel=4 does not divide "
                                            r"model\.numAttentionHeads=6"):
        resolve_pool(pool, None)


def test_owned_pools_fail_on_the_inference_model():
    spec = InferenceModelSpec.model_validate({"model": {**MODEL, "numLayers": 2},
                                              "topology": {"pipelineParallel": 4}})
    with pytest.raises(TopologyError, match=r"topology\.pipelineParallel=4 exceeds"):
        owned_pools(spec, "m")


def test_resolved_json_is_the_stored_spec_with_the_inherited_sections():
    for stored in pool_specs(OWNER, "m"):
        got = resolve_pool(stored, OWNER).to_json()
        assert got == {**stored.to_json(), "model": OWNER.model.to_json(),
                       "engine": OWNER.engine.to_json()}


def test_spec_hash_is_unchanged():
    # Pods carry the hash; a new value for the same spec would roll every pod of every pool
    # on an operator upgrade. This is the value the first release computes for the pool.
    spec = InferenceModelSpec.model_validate({
        "model": {"name": "tiny-llama", "source": "dummy:tiny-llama"},
        "engine": {"dtype": "float32", "maxModelLen": 512, "maxNumSeqs": 16,
                   "maxNumBatchedTokens": 512, "kvCacheMemory": "64MiB"},
        "accelerator": {"vendor": "cpu"}, "overrides": {"resources": {
            "requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}}}})
    (pool,) = owned_pools(spec, "tiny")
    assert spec_hash(pool.resolved) == "9fe345ffd093622f"
