"""Mixtral: the Llama decoder with each MLP replaced by a sparse mixture of experts.

Under tensor parallelism the hidden states are the same on every rank, so each rank
routes every token and runs only what it holds: with expert parallelism equal to TP,
its whole experts; with EP 1, its slice of every expert's intermediate size. One
all-reduce adds the ranks' contributions either way.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kvpilot.engine.attention.backend import AttentionBackend
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.layers import FeedForward, WeightLayout, WeightSlot, rows_source
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.parallel.groups import SINGLE_RANK, TPGroup
from kvpilot.engine.parallel.stage import PipelineStage


class SparseMoE(FeedForward):
    """Routes each token to its top-k experts (softmax over router logits, top-k weights
    renormalised to sum to one, as HF does) and sums their SwiGLU outputs."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.intermediate_size
        self.num_experts, self.intermediate_size = experts, inter
        self.top_k = config.num_experts_per_tok
        self.tp = tp
        self.local_experts = tp.experts(experts)
        self.local_rows = tp.expert_rows(inter)
        local, rows = self.local_experts, self.local_rows
        num_local, local_inter = local.stop - local.start, rows.stop - rows.start
        self.gate = nn.Linear(hidden, experts, bias=False)
        # Experts stacked in one tensor each, [gate | up] rows then down, so a fused MoE
        # kernel can take them as they are.
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * local_inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, local_inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gives the mixture's output [T, hidden] for `x` [T, hidden]."""
        weights, experts = self.route(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.tp.all_reduce(self._dense(x, weights, experts))
        out = torch.zeros_like(x)
        first = self.local_experts.start
        # Loop over this rank's experts that got tokens, not over tokens.
        for expert in experts.unique().tolist():
            if not first <= expert < self.local_experts.stop:
                continue
            rows, slot = torch.where(experts == expert)
            w13, w2 = self.w13[expert - first], self.w2[expert - first]
            y = F.linear(self.act(F.linear(x[rows], w13)), w2)
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return self.tp.all_reduce(out)

    def _dense(self, x: torch.Tensor, weights: torch.Tensor,
               experts: torch.Tensor) -> torch.Tensor:
        """Gives the same mixture with every local expert run on every token, weighted by
        zero where not routed: no data-dependent shapes or host syncs, so a CUDA graph can
        hold it (decode batches read every expert's weights anyway)."""
        out = torch.zeros_like(x)
        for i in range(self.w13.shape[0]):
            gate = (weights * (experts == self.local_experts.start + i)).sum(dim=-1, keepdim=True)
            y = F.linear(self.act(F.linear(x, self.w13[i])), self.w2[i])
            out += y * gate
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gives (weights [T, k] in x's dtype, expert ids [T, k]) chosen for each token."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def weight_layout(self, prefix: str) -> WeightLayout:
        """Gives the checkpoint layout of one layer's router and (this rank's part of) its
        experts; other ranks' experts map to no parameter."""
        inter, hidden = self.intermediate_size, self.w13.shape[2]
        rows, local = self.local_rows, self.local_experts
        n = rows.stop - rows.start
        # HF keeps the module name `block_sparse_moe`; ours is `mlp` like the dense layers.
        src, dst = f"{prefix}.block_sparse_moe", f"{prefix}.mlp"
        layout: WeightLayout = {f"{src}.gate.weight": WeightSlot(
            f"{dst}.gate.weight", tuple(self.gate.weight.shape))}
        for e in range(self.num_experts):
            names = [f"{src}.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2")]
            if not local.start <= e < local.stop:
                for name, shape in zip(names, [(inter, hidden)] * 2 + [(hidden, inter)],
                                       strict=True):
                    layout[name] = WeightSlot(None, shape)
                continue
            i = e - local.start
            source = rows_source(rows, inter)
            layout[names[0]] = WeightSlot(f"{dst}.w13", (inter, hidden), (i, slice(0, n)), source)
            layout[names[1]] = WeightSlot(f"{dst}.w13", (inter, hidden), (i, slice(n, 2 * n)),
                                          source)
            layout[names[2]] = WeightSlot(f"{dst}.w2", (hidden, inter), (i,),
                                          rows_source(rows, inter, dim=1))
        return layout


class MixtralForCausalLM(LlamaForCausalLM):
    """Sparse-MoE causal LM in the Mixtral checkpoint layout (`block_sparse_moe`)."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None,
                 tp: TPGroup = SINGLE_RANK, stage: PipelineStage | None = None) -> None:
        if config.num_experts < 1 or not 1 <= config.num_experts_per_tok <= config.num_experts:
            raise ValueError(
                f"num_local_experts={config.num_experts} and num_experts_per_tok="
                f"{config.num_experts_per_tok} in config.json are invalid: need "
                "1 <= num_experts_per_tok <= num_local_experts")
        super().__init__(config, attn_backend, make_mlp=SparseMoE, tp=tp, stage=stage)
