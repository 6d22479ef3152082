"""Accelerator facts: the MI300X partition table, resource names, node labels, memory fit."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpilot.operator.api import AcceleratorSpec
from kvpilot.operator.planning.accelerators import (
    GB,
    AcceleratorError,
    amd_mode,
    bytes_per_param,
    check_memory_fit,
    placement,
)

# (compute, memory) -> (logical GPUs per node, GB per logical GPU, label value)
MI300X_TABLE = {
    ("SPX", "NPS1"): (8, 192, "spx_nps1"),
    ("DPX", "NPS1"): (16, 96, "dpx_nps1"),
    ("QPX", "NPS1"): (32, 48, "qpx_nps1"),
    ("CPX", "NPS1"): (64, 24, "cpx_nps1"),
    ("CPX", "NPS4"): (64, 24, "cpx_nps4"),
}


@pytest.mark.parametrize(("mode", "expected"), MI300X_TABLE.items(), ids=str)
def test_mi300x_partition_table(mode: tuple[str, str], expected: tuple[int, int, str]):
    got = amd_mode("MI300X", *mode)
    assert (got.gpus_per_node, got.memory_gb_per_gpu, got.label_value) == expected
    assert got.mixed_resource == f"amd.com/{expected[2]}"


@pytest.mark.parametrize("mode", [("SPX", "NPS4"), ("DPX", "NPS4"), ("QPX", "NPS4")])
def test_invalid_mi300x_modes(mode: tuple[str, str]):
    with pytest.raises(AcceleratorError, match=f"computePartition={mode[0]} with "
                                               f"memoryPartition={mode[1]} is not a valid"):
        amd_mode("MI300X", *mode)


@pytest.mark.parametrize("model", ["MI210", "MI250X", "MI999"])
def test_only_cdna3_models_partition(model: str):
    with pytest.raises(AcceleratorError, match=f"accelerator.model='{model}' cannot be "
                                               "partitioned: remove computePartition"):
        amd_mode(model, "CPX", "NPS1")


def test_mi325x_scales_memory():
    assert amd_mode("MI325X", "CPX", "NPS1").memory_gb_per_gpu == 32


def _acc(**kw: object) -> AcceleratorSpec:
    return AcceleratorSpec.model_validate(kw)


# (id, spec, resource, gpus per node, memory GB per GPU, selector terms, toleration key)
PLACEMENTS = [
    ("cpu", _acc(vendor="cpu"), None, 1, None, [], None),
    ("nvidia-any", _acc(), "nvidia.com/gpu", 8, None, [], "nvidia.com/gpu"),
    ("h100", _acc(model="H100-80GB"), "nvidia.com/gpu", 8, 80,
     [[("nvidia.com/gpu.product", ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"])]],
     "nvidia.com/gpu"),
    ("h200-4-per-node", _acc(model="H200", gpusPerNode=4), "nvidia.com/gpu", 4, 141,
     [[("nvidia.com/gpu.product", ["NVIDIA-H200"])]], "nvidia.com/gpu"),
    ("amd-unpartitioned", _acc(vendor="amd", model="MI300X"), "amd.com/gpu", 8, 192, [],
     "amd.com/gpu"),
    ("amd-cpx-nps4-single", _acc(vendor="amd", computePartition="CPX", memoryPartition="NPS4"),
     "amd.com/gpu", 64, 24,
     [[("amd.com/compute-memory-partition", ["cpx_nps4"])],
      [("amd.com/gpu.compute-memory-partition", ["cpx_nps4"])]], "amd.com/gpu"),
    ("amd-cpx-nps4-mixed", _acc(vendor="amd", computePartition="CPX", memoryPartition="NPS4",
                                resourceNaming="mixed"), "amd.com/cpx_nps4", 64, 24,
     [[("amd.com/compute-memory-partition", ["cpx_nps4"])],
      [("amd.com/gpu.compute-memory-partition", ["cpx_nps4"])]], "amd.com/gpu"),
    ("amd-dpx-defaults-nps1", _acc(vendor="amd", computePartition="DPX",
                                   resourceNaming="mixed"), "amd.com/dpx_nps1", 16, 96,
     [[("amd.com/compute-memory-partition", ["dpx_nps1"])],
      [("amd.com/gpu.compute-memory-partition", ["dpx_nps1"])]], "amd.com/gpu"),
]


@pytest.mark.parametrize(("acc", "resource", "per_node", "memory_gb", "terms", "taint"),
                         [p[1:] for p in PLACEMENTS], ids=[p[0] for p in PLACEMENTS])
def test_placement(acc: AcceleratorSpec, resource: str | None, per_node: int,
                   memory_gb: int | None, terms: list, taint: str | None):
    got = placement(acc)
    assert got.resource_name == resource
    assert got.gpus_per_node == per_node
    assert got.memory_bytes_per_gpu == (memory_gb * GB if memory_gb else None)
    assert [[(e["key"], e["values"]) for e in term] for term in got.node_selector_terms] == terms
    assert all(e["operator"] == "In" for term in got.node_selector_terms for e in term)
    assert [t["key"] for t in got.tolerations] == ([taint] if taint else [])


def test_unknown_nvidia_model_names_the_field():
    with pytest.raises(ValidationError, match=r"model=V100.*accelerator.model is not a known "
                                              r"NVIDIA model: use one of H100-80GB, H200"):
        _acc(model="V100")


@pytest.mark.parametrize(("dtype", "vendor", "expected"), [
    ("auto", "nvidia", 2), ("auto", "cpu", 4), ("float32", "amd", 4), ("bfloat16", "cpu", 2),
    ("float16", "nvidia", 2),
])
def test_bytes_per_param(dtype: str, vendor: str, expected: int):
    assert bytes_per_param(dtype, vendor) == expected


def test_memory_fit_message_has_the_arithmetic():
    with pytest.raises(AcceleratorError) as err:
        check_memory_fit(100 * GB, 2, 48 * GB, where="MI300X QPX/NPS1")
    assert str(err.value) == (
        "model weights 100.0 GB / 2 GPU(s) = 50.0 GB per GPU exceed 48.0 GB x 0.90 utilization "
        "x 0.90 (KV-cache headroom) = 38.9 GB on MI300X QPX/NPS1: raise topology.tensorParallel "
        "x pipelineParallel to at least 3 GPUs or pick an accelerator with more memory per GPU")


@given(weights=st.integers(1, 2000), memory=st.integers(1, 200), gpus=st.integers(1, 64))
def test_memory_fit_suggestion_is_enough(weights: int, memory: int, gpus: int):
    """When a fit fails, the suggested GPU count passes the same check."""
    try:
        check_memory_fit(weights * GB, gpus, memory * GB)
    except AcceleratorError as err:
        needed = int(str(err).split("at least ")[1].split(" GPUs")[0])
        assert needed > gpus
        check_memory_fit(weights * GB, needed, memory * GB)
