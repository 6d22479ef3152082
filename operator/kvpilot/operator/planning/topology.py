"""Topology planning: how many GPUs, pods and nodes one replica of TP x PP (x EP) needs.

Rules, each an error naming the field and the arithmetic:
- tensorParallel divides numAttentionHeads (each rank gets whole heads);
- KV heads: when TP exceeds numKeyValueHeads, TP must be a multiple of them and each
  KV head is replicated TP / kvHeads times; otherwise TP must divide them;
- pipelineParallel <= numLayers (every stage gets at least one layer);
- expertParallel divides numExperts and is 1 or tensorParallel (a layer's experts are split
  across that layer's tensor-parallel ranks, as vLLM's expert parallelism does with DP=1:
  whole experts per rank when EP == TP, every expert TP-sharded when EP == 1; the engine
  refuses 1 < EP < TP, so no pod is rendered that it would refuse);
- tensorParallel <= GPUs per node (TP all-reduces every layer; it stays on NVLink/xGMI);
  pipeline stages may span nodes, one pod per node, each pod holding whole stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.operator.api.accelerator import AcceleratorSpec
from kvpilot.operator.api.common import EngineSpec, ModelSource, TopologySpec
from kvpilot.operator.planning.accelerators import (
    Placement,
    check_memory_fit,
    placement,
)
from kvpilot.operator.planning.quantization import weight_bytes as quantized_weight_bytes


class TopologyError(ValueError):
    """A topology the model or the nodes cannot run; the message names the field and the fix."""


@dataclass(frozen=True)
class TopologyPlan:
    """The shape of one replica."""

    tensor_parallel: int
    pipeline_parallel: int
    expert_parallel: int
    ranks_per_replica: int
    """Engine processes (ranks) of one replica: TP x PP."""
    gpus_per_replica: int
    """GPUs one replica requests (0 on CPU)."""
    nodes_per_replica: int
    """Pods (one per node) one replica spans."""
    gpus_per_pod: int
    """GPUs each pod requests (0 on CPU)."""
    stages_per_pod: int
    """Pipeline stages each pod runs."""
    kv_head_replication: int
    """Copies of each KV head across TP ranks (1: no replication)."""
    placement: Placement

    @property
    def multi_node(self) -> bool:
        """Gives whether a replica spans more than one node (leader/worker group)."""
        return self.nodes_per_replica > 1


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check_model(topo: TopologySpec, model: ModelSource) -> int:
    """Checks TP/PP/EP against the model's shape; gives the KV-head replication factor."""
    tp, pp, ep = topo.tensor_parallel, topo.pipeline_parallel, topo.expert_parallel
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    if heads is not None and heads % tp:
        raise TopologyError(
            f"topology.tensorParallel={tp} does not divide model.numAttentionHeads={heads} "
            f"({heads} % {tp} = {heads % tp}): use one of {_divisors(heads)}")
    replication = 1
    if kv_heads is not None:
        if tp > kv_heads and tp % kv_heads:
            raise TopologyError(
                f"topology.tensorParallel={tp} exceeds model.numKeyValueHeads={kv_heads} but is "
                f"not a multiple of it ({tp} % {kv_heads} = {tp % kv_heads}): KV heads can only "
                f"be replicated whole; use a multiple of {kv_heads}")
        if tp <= kv_heads and kv_heads % tp:
            raise TopologyError(
                f"topology.tensorParallel={tp} does not divide model.numKeyValueHeads={kv_heads} "
                f"({kv_heads} % {tp} = {kv_heads % tp}): use one of {_divisors(kv_heads)}")
        replication = max(1, tp // kv_heads)
    if model.num_layers is not None and pp > model.num_layers:
        raise TopologyError(
            f"topology.pipelineParallel={pp} exceeds model.numLayers={model.num_layers}: "
            f"each stage needs at least one layer; use at most {model.num_layers}")
    if ep > 1:
        experts = model.num_experts
        if experts is not None and experts % ep:
            raise TopologyError(
                f"topology.expertParallel={ep} does not divide model.numExperts={experts} "
                f"({experts} % {ep} = {experts % ep}): use one of {_divisors(experts)}")
        if tp % ep:
            raise TopologyError(
                f"topology.expertParallel={ep} does not divide topology.tensorParallel={tp} "
                f"({tp} % {ep} = {tp % ep}): experts are split across a layer's TP ranks; "
                f"use one of {_divisors(tp)}")
        if ep != tp:
            raise TopologyError(
                f"topology.expertParallel={ep} with topology.tensorParallel={tp} is not supported: "
                f"the engine runs expertParallel 1 (every expert sharded across the TP ranks) or "
                f"equal to tensorParallel (experts partitioned whole); use 1 or {tp}")
    return replication


def _pods(tp: int, pp: int, gpus_per_node: int) -> int:
    """Gives the fewest nodes that hold PP stages of TP GPUs with equal stages per node."""
    stages_per_node = gpus_per_node // tp
    nodes = math.ceil(pp / stages_per_node)
    while pp % nodes:  # identical pods: each must carry the same number of stages
        nodes += 1
    return nodes


def plan(topo: TopologySpec, model: ModelSource, acc: AcceleratorSpec,
         engine: EngineSpec | None = None) -> TopologyPlan:
    """Gives the replica shape; raises TopologyError (or AcceleratorError when the weights
        do not fit the GPUs) with the arithmetic in the message."""
    tp, pp, ep = topo.tensor_parallel, topo.pipeline_parallel, topo.expert_parallel
    replication = _check_model(topo, model)
    where = placement(acc)
    ranks = tp * pp
    if acc.vendor == "cpu":
        # CPU ranks are processes in one pod; there is no per-node device limit to respect.
        return TopologyPlan(tp, pp, ep, ranks, 0, 1, 0, pp, replication, where)
    per_node = where.gpus_per_node
    if tp > per_node:
        raise TopologyError(
            f"topology.tensorParallel={tp} exceeds the {per_node} GPUs of one node "
            f"(accelerator.gpusPerNode or the partition's count): tensor parallelism stays "
            f"within a node; lower tensorParallel to {per_node} or less and raise "
            "pipelineParallel to span nodes")
    nodes = 1 if ranks <= per_node else _pods(tp, pp, per_node)
    if where.memory_bytes_per_gpu is not None:
        _check_fit(model, engine or EngineSpec(), acc, ranks, where)
    return TopologyPlan(tp, pp, ep, ranks, ranks, nodes, ranks // nodes, pp // nodes,
                        replication, where)


def _check_fit(model: ModelSource, engine: EngineSpec, acc: AcceleratorSpec, gpus: int,
               where: Placement) -> None:
    weight_bytes = model.weight_bytes
    if weight_bytes is None and model.parameter_count is not None:
        weight_bytes = quantized_weight_bytes(model.parameter_count, engine, acc.vendor)
    if weight_bytes is None or where.memory_bytes_per_gpu is None:
        return
    mode = f" {acc.compute_partition}/{acc.memory_partition or 'NPS1'}" \
        if acc.compute_partition else ""
    check_memory_fit(weight_bytes, gpus, where.memory_bytes_per_gpu,
                     utilization=engine.gpu_memory_utilization
                     or EngineArgs.gpu_memory_utilization,
                     where=f"{acc.model or acc.vendor}{mode}")
