"""Mixtral: the Llama decoder with each MLP replaced by a sparse mixture of experts."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kvpilot.engine.attention.backend import AttentionBackend
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.layers import FeedForward, WeightLayout
from kvpilot.engine.models.llama import LlamaForCausalLM


class SparseMoE(FeedForward):
    """Routes each token to its top-k experts (softmax over router logits, top-k weights
    renormalised to sum to one, as HF does) and sums their SwiGLU outputs."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.intermediate_size
        self.num_experts, self.intermediate_size = experts, inter
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(hidden, experts, bias=False)
        # Experts stacked in one tensor each, [gate | up] rows then down, so a fused MoE
        # kernel can take them as they are.
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Gives the mixture's output [T, hidden] for `x` [T, hidden]."""
        weights, experts = self.route(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._dense(x, weights, experts)
        out = torch.zeros_like(x)
        # Loop over the experts that got tokens, not over tokens.
        for expert in experts.unique().tolist():
            rows, slot = torch.where(experts == expert)
            y = F.linear(self.act(F.linear(x[rows], self.w13[expert])), self.w2[expert])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out

    def _dense(self, x: torch.Tensor, weights: torch.Tensor,
               experts: torch.Tensor) -> torch.Tensor:
        """Gives the same mixture with every expert run on every token, weighted by zero
        where not routed: no data-dependent shapes or host syncs, so a CUDA graph can
        hold it (decode batches read every expert's weights anyway)."""
        out = torch.zeros_like(x)
        for expert in range(self.w13.shape[0]):
            gate = (weights * (experts == expert)).sum(dim=-1, keepdim=True)
            y = F.linear(self.act(F.linear(x, self.w13[expert])), self.w2[expert])
            out += y * gate
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gives (weights [T, k] in x's dtype, expert ids [T, k]) chosen for each token."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def weight_layout(self, prefix: str) -> WeightLayout:
        """Gives the checkpoint layout of one layer's experts and router."""
        inter = self.intermediate_size
        # HF keeps the module name `block_sparse_moe`; ours is `mlp` like the dense layers.
        src, dst = f"{prefix}.block_sparse_moe", f"{prefix}.mlp"
        layout: WeightLayout = {f"{src}.gate.weight": (f"{dst}.gate.weight", ())}
        for e in range(self.num_experts):
            layout[f"{src}.experts.{e}.w1.weight"] = (f"{dst}.w13", (e, slice(0, inter)))
            layout[f"{src}.experts.{e}.w3.weight"] = (f"{dst}.w13", (e, slice(inter, 2 * inter)))
            layout[f"{src}.experts.{e}.w2.weight"] = (f"{dst}.w2", (e,))
        return layout


class MixtralForCausalLM(LlamaForCausalLM):
    """Sparse-MoE causal LM in the Mixtral checkpoint layout (`block_sparse_moe`)."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None) -> None:
        if config.num_experts < 1 or not 1 <= config.num_experts_per_tok <= config.num_experts:
            raise ValueError(
                f"num_local_experts={config.num_experts} and num_experts_per_tok="
                f"{config.num_experts_per_tok} in config.json are invalid: need "
                "1 <= num_experts_per_tok <= num_local_experts")
        super().__init__(config, attn_backend, make_mlp=SparseMoE)
