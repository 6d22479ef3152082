"""Topology planning: replica shapes and the errors that name the field and the arithmetic."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpilot.operator.api import AcceleratorSpec, EngineSpec, ModelSource, TopologySpec
from kvpilot.operator.planning.accelerators import AcceleratorError
from kvpilot.operator.planning.topology import TopologyError, plan

LLAMA_70B = ModelSource(name="llama-70b", source="hf://meta-llama/Llama-3.1-70B-Instruct",
                        num_attention_heads=64, num_key_value_heads=8, num_layers=80,
                        parameter_count=70_600_000_000)
MIXTRAL = ModelSource(name="mixtral", source="hf://mistralai/Mixtral-8x7B-v0.1",
                      num_attention_heads=32, num_key_value_heads=8, num_layers=32,
                      num_experts=8, parameter_count=46_700_000_000)
TINY = ModelSource(name="tiny", source="dummy:tiny-llama")
H100 = AcceleratorSpec(vendor="nvidia", model="H100-80GB")
CPX_NPS4 = AcceleratorSpec(vendor="amd", model="MI300X", compute_partition="CPX",
                           memory_partition="NPS4")


def topo(tp: int = 1, pp: int = 1, ep: int = 1) -> TopologySpec:
    return TopologySpec(tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)


# (id, topology, model, accelerator,
#  (ranks, gpus/replica, nodes, gpus/pod, stages/pod, kv replication))
SHAPES = [
    ("tiny-cpu", topo(), TINY, AcceleratorSpec(vendor="cpu"), (1, 0, 1, 0, 1, 1)),
    ("tiny-cpu-tp2", topo(tp=2), TINY, AcceleratorSpec(vendor="cpu"), (2, 0, 1, 0, 1, 1)),
    ("70b-tp8-h100", topo(tp=8), LLAMA_70B, H100, (8, 8, 1, 8, 1, 1)),
    ("70b-tp8-pp2-two-nodes", topo(tp=8, pp=2), LLAMA_70B, H100, (16, 16, 2, 8, 1, 1)),
    ("70b-tp4-pp4-two-nodes", topo(tp=4, pp=4), LLAMA_70B, H100, (16, 16, 2, 8, 2, 1)),
    ("70b-tp4-pp3-uneven-becomes-three", topo(tp=4, pp=3), LLAMA_70B, H100, (12, 12, 3, 4, 1, 1)),
    ("tp16-replicates-kv", topo(tp=16), LLAMA_70B,
     AcceleratorSpec(vendor="nvidia", gpus_per_node=16), (16, 16, 1, 16, 1, 2)),
    ("mixtral-ep8-cpx", topo(tp=8, ep=8), MIXTRAL, CPX_NPS4, (8, 8, 1, 8, 1, 1)),
    ("70b-tp8-pp8-cpx-one-node", topo(tp=8, pp=8), LLAMA_70B, CPX_NPS4, (64, 64, 1, 64, 8, 1)),
    ("no-hints-no-checks", topo(tp=3, pp=5), TINY, AcceleratorSpec(vendor="nvidia"),
     (15, 15, 5, 3, 1, 1)),
]


@pytest.mark.parametrize(("spec", "model", "acc", "expected"), [s[1:] for s in SHAPES],
                         ids=[s[0] for s in SHAPES])
def test_shapes(spec: TopologySpec, model: ModelSource, acc: AcceleratorSpec,
                expected: tuple[int, ...]):
    p = plan(spec, model, acc)
    got = (p.ranks_per_replica, p.gpus_per_replica, p.nodes_per_replica, p.gpus_per_pod,
           p.stages_per_pod, p.kv_head_replication)
    assert got == expected
    assert p.multi_node == (expected[2] > 1)


ERRORS = [
    ("tp-not-dividing-heads", topo(tp=3), LLAMA_70B, AcceleratorSpec(gpus_per_node=8),
     TopologyError, "topology.tensorParallel=3 does not divide model.numAttentionHeads=64 "
                    "(64 % 3 = 1): use one of 1, 2, 4, 8, 16, 32, 64"),
    ("tp-not-multiple-of-kv", topo(tp=12),
     ModelSource(name="x", source="dummy:x", num_attention_heads=96, num_key_value_heads=8),
     AcceleratorSpec(gpus_per_node=16), TopologyError,
     "topology.tensorParallel=12 exceeds model.numKeyValueHeads=8 but is not a multiple of it "
     "(12 % 8 = 4)"),
    ("tp-not-dividing-kv", topo(tp=4),
     ModelSource(name="x", source="dummy:x", num_attention_heads=24, num_key_value_heads=6),
     AcceleratorSpec(), TopologyError,
     "topology.tensorParallel=4 does not divide model.numKeyValueHeads=6 (6 % 4 = 2)"),
    ("pp-over-layers", topo(pp=4), ModelSource(name="x", source="dummy:x", num_layers=2),
     AcceleratorSpec(), TopologyError,
     "topology.pipelineParallel=4 exceeds model.numLayers=2: each stage needs at least one "
     "layer; use at most 2"),
    ("ep-not-dividing-experts", topo(tp=8, ep=3), MIXTRAL, H100, TopologyError,
     "topology.expertParallel=3 does not divide model.numExperts=8 (8 % 3 = 2)"),
    ("ep-not-dividing-tp", topo(tp=2, ep=4), MIXTRAL, H100, TopologyError,
     "topology.expertParallel=4 does not divide topology.tensorParallel=2 (2 % 4 = 2)"),
    ("ep-between-one-and-tp", topo(tp=8, ep=4), MIXTRAL, H100, TopologyError,
     "topology.expertParallel=4 with topology.tensorParallel=8 is not supported: the engine "
     "runs expertParallel 1 (every expert sharded across the TP ranks) or equal to "
     "tensorParallel (experts partitioned whole); use 1 or 8"),
    ("tp-over-node", topo(tp=16), LLAMA_70B, H100, TopologyError,
     "topology.tensorParallel=16 exceeds the 8 GPUs of one node"),
    ("tp-over-partitioned-node", topo(tp=16), TINY,
     AcceleratorSpec(vendor="amd", compute_partition="SPX"), TopologyError,
     "topology.tensorParallel=16 exceeds the 8 GPUs of one node"),
    ("70b-does-not-fit-tp2", topo(tp=2), LLAMA_70B, H100, AcceleratorError,
     "model weights 141.2 GB / 2 GPU(s) = 70.6 GB per GPU exceed 80.0 GB x 0.90 utilization x "
     "0.90 (KV-cache headroom) = 64.8 GB on H100-80GB: raise topology.tensorParallel x "
     "pipelineParallel to at least 3 GPUs"),
    ("70b-does-not-fit-cpx", topo(tp=4), LLAMA_70B, CPX_NPS4, AcceleratorError,
     "= 35.3 GB per GPU exceed 24.0 GB x 0.90 utilization x 0.90 (KV-cache headroom) = 19.4 GB "
     "on MI300X CPX/NPS4: raise topology.tensorParallel x pipelineParallel to at least 8 GPUs"),
]


@pytest.mark.parametrize(("spec", "model", "acc", "error", "message"), [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])
def test_errors(spec: TopologySpec, model: ModelSource, acc: AcceleratorSpec,
                error: type[Exception], message: str):
    with pytest.raises(error) as err:
        plan(spec, model, acc)
    assert message in str(err.value)


def test_fp32_doubles_the_weights():
    """parameterCount x 4 bytes with float32: 70B no longer fits TP=4 on 80 GB."""
    fp32 = EngineSpec(dtype="float32")
    plan(topo(tp=4), LLAMA_70B, H100)
    with pytest.raises(AcceleratorError, match=r"282\.4 GB / 4 GPU"):
        plan(topo(tp=4), LLAMA_70B, H100, fp32)


def test_weight_bytes_win_over_parameter_count():
    quantised = LLAMA_70B.model_copy(update={"weight_bytes": 40 * 10**9})
    assert plan(topo(tp=1), quantised, H100).gpus_per_replica == 1


@given(tp=st.sampled_from([1, 2, 4, 8]), pp=st.integers(1, 16),
       per_node=st.sampled_from([8, 16, 32, 64]))
def test_layout_invariants(tp: int, pp: int, per_node: int):
    """Pods are identical, hold whole stages, fit a node, and add up to the replica."""
    p = plan(topo(tp=tp, pp=pp), TINY, AcceleratorSpec(gpus_per_node=per_node))
    assert p.gpus_per_pod * p.nodes_per_replica == p.gpus_per_replica == tp * pp
    assert p.stages_per_pod * p.nodes_per_replica == pp
    assert p.gpus_per_pod <= per_node
    assert p.gpus_per_pod % tp == 0
    if tp * pp <= per_node:
        assert p.nodes_per_replica == 1


@given(tp=st.integers(1, 16), pp=st.integers(1, 8), ep=st.integers(1, 8),
       heads=st.sampled_from([8, 12, 32, 40, 64]), kv=st.sampled_from([1, 2, 4, 8]),
       layers=st.integers(1, 12), experts=st.sampled_from([8, 16, 60, 64]))
def test_plan_accepts_exactly_the_valid_shapes(tp: int, pp: int, ep: int, heads: int, kv: int,
                                               layers: int, experts: int):
    """An oracle of the documented rules; rejections always name a topology field."""
    model = ModelSource(name="m", source="dummy:m", num_attention_heads=heads,
                        num_key_value_heads=kv, num_layers=layers, num_experts=experts)
    valid = (heads % tp == 0
             and (kv % tp == 0 if tp <= kv else tp % kv == 0)
             and pp <= layers
             and (ep == 1 or (experts % ep == 0 and ep == tp))
             and tp <= 8)
    try:
        p = plan(topo(tp, pp, ep), model, AcceleratorSpec(gpus_per_node=8))
    except TopologyError as err:
        assert not valid
        assert str(err).startswith("topology.")
        return
    assert valid
    assert p.kv_head_replication == max(1, tp // kv)
