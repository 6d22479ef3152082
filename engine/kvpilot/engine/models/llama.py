"""The dense decoder family: Llama 2/3, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k norm).

One flat batch of T tokens goes through every layer; attention reads and writes
the paged KV cache through `model.attn_backend`, which the model runner may swap
(torch reference on CPU, Triton on GPU). Under tensor parallelism (`tp`) each rank
holds its heads, its KV heads and its slice of the MLP; the attention and MLP outputs
are all-reduced inside the residual norm after them (`RMSNorm.sum_over`), so the residual
stream is the same on every rank. Under
pipeline parallelism (`stage`) a rank builds only its stage's layers: the embedding on the
first stage, the final norm and LM head on the last; `forward_stage` runs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeAlias

import torch
from torch import nn

from kvpilot.engine.attention.backend import AttentionBackend
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.layers import (
    FeedForward,
    MergedLinear,
    RMSNorm,
    WeightLayout,
    WeightSlot,
    whole,
)
from kvpilot.engine.models.parallel_layers import (
    VocabShard,
    linear_layout,
    lm_head,
    row_parallel_linear,
    sum_in_next_norm,
    vocab_embedding,
)
from kvpilot.engine.models.rope import KernelRope, RotaryEmbedding, StepRope
from kvpilot.engine.parallel.groups import SINGLE_RANK, TPGroup, shard_slice
from kvpilot.engine.parallel.stage import Intermediate, PipelineStage

# builds one layer's feed-forward block (dense MLP or mixture of experts) for a TP rank
MakeMLP: TypeAlias = Callable[[ModelConfig, TPGroup], FeedForward]


@dataclass
class AttentionInputs:
    """One layer's q [T, heads, d], k and v [T, kv_heads, d] for its attention backend, and
    whether k and v are in the KV cache already (a fused kernel wrote them)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_written: bool


class Attention(nn.Module):
    """Grouped-query self-attention over the paged cache (this rank's heads), in two halves
    around the attention backend's call: `project` (q, k, v, norms, rotary, maybe the KV
    write) and `output` (the output projection); the decoder layer calls the backend between
    them, and a mixed step's piecewise graphs end and begin there (`piecewise_graphs`)."""

    def __init__(self, config: ModelConfig, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        d = self.head_dim = config.head_dim
        heads = shard_slice(config.num_heads, tp.rank, tp.size)
        kv_heads = tp.kv_heads(config.num_kv_heads)
        self.num_heads = heads.stop - heads.start
        self.num_kv_heads = kv_heads.stop - kv_heads.start
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        full_q, full_kv = config.num_heads * d, config.num_kv_heads * d
        kv_rows = slice(kv_heads.start * d, kv_heads.stop * d)
        self.qkv_proj = MergedLinear(
            config.hidden_size, [q_size, kv_size, kv_size], bias=config.attention_bias,
            full_sizes=[full_q, full_kv, full_kv],
            sources=[slice(heads.start * d, heads.stop * d), kv_rows, kv_rows])
        self.o_proj = row_parallel_linear(full_q, config.hidden_size, config.o_proj_bias, tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        # qk_norm + rotary in one in-place kernel, with the signature of
        # kvpilot.kernels.qk_norm_rotary.qk_norm_rotary; set by `fused.use_fused_kernels`
        # (qk_norm layers only) and used when the step's rope is a KernelRope
        self.qk_norm_rope: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        # without q/k norms: rotary + the KV-cache write in one kernel, with the signature of
        # kvpilot.kernels.qk_norm_rotary.rotary_kv_write (set and used likewise)
        self.rope_kv_write: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        self.scale = self.head_dim ** -0.5
        # an fp8 KV cache's per-layer (k, v) scales; 1.0: no calibrated scales are read yet
        self.kv_scales = (1.0, 1.0)

    def project(self, rope: StepRope, x: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> AttentionInputs:
        """Gives what the attention backend takes for `x` [T, hidden]: q, k, v (normed and
        rotated), and whether a fused kernel already wrote k, v into `kv_cache` (only
        `meta.slot_mapping` is read)."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        kv_written = False
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (qk_norm)
            if self.qk_norm_rope is not None and isinstance(rope, KernelRope):
                # one launch instead of four: q/k norms, rotary and the KV-cache write, with
                # the same bits as the four
                q, k = self.qk_norm_rope(rope.positions, q, k, self.q_norm.weight,
                                         self.k_norm.weight, self.q_norm.eps, rope.cos_sin,
                                         v=v, kv_cache=kv_cache, slot_mapping=meta.slot_mapping,
                                         kv_scales=self.kv_scales)
                kv_written = True
            else:
                q, k = rope.apply(self.q_norm(q), self.k_norm(k))
        elif self.rope_kv_write is not None and isinstance(rope, KernelRope):
            q, k = self.rope_kv_write(rope.positions, q, k, rope.cos_sin, v, kv_cache,
                                      meta.slot_mapping, self.kv_scales)
            kv_written = True
        else:
            q, k = rope.apply(q, k)
        return AttentionInputs(q, k, v, kv_written)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """Gives the output projection [T, hidden] of the attention output [T, heads, d]."""
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


class MLP(FeedForward):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), this rank's slice of it."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        rows = shard_slice(intermediate_size, tp.rank, tp.size)
        local = rows.stop - rows.start
        self.gate_up_proj = MergedLinear(hidden_size, [local] * 2, bias=bias,
                                         full_sizes=[intermediate_size] * 2, sources=[rows] * 2)
        self.down_proj = row_parallel_linear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def weight_layout(self, prefix: str) -> WeightLayout:
        """Gives the checkpoint layout of one layer's dense MLP."""
        layout = self.gate_up_proj.weight_layout(f"{prefix}.mlp", "gate_up_proj",
                                                 ["gate_proj", "up_proj"])
        layout |= linear_layout(f"{prefix}.mlp.down_proj", self.down_proj)
        return layout


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); `mlp` may be an MoE block.

    The residual stream travels beside the hidden states (as in vLLM), so each
    residual add happens inside the next norm, where a fused kernel can do both.
    """

    def __init__(self, config: ModelConfig, mlp: FeedForward, tp: TPGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, rope: StepRope, x: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """Gives (this layer's output, the residual stream it has not added in yet)."""
        step, stream = self.attention_inputs(rope, x, residual, kv_cache, meta)
        attn = self.self_attn
        out = backend.forward(step.q, step.k, step.v, kv_cache, meta, attn.scale,
                              attn.kv_scales, kv_written=step.kv_written)
        return self.finish(out, stream)

    def attention_inputs(self, rope: StepRope, x: torch.Tensor, residual: torch.Tensor | None,
                         kv_cache: torch.Tensor, meta: AttentionMetadata
                         ) -> tuple[AttentionInputs, torch.Tensor]:
        """Gives the layer up to its attention: (the backend's inputs, the residual stream)."""
        if residual is None:
            stream, h = x, self.input_layernorm(x)
        else:
            h, stream = self.input_layernorm(x, residual)
        return self.self_attn.project(rope, h, kv_cache, meta), stream

    def finish(self, out: torch.Tensor, stream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gives the layer after its attention output `out` [T, heads, d]: (its output, the
        residual stream it has not added in yet)."""
        h, stream = self.post_attention_layernorm(self.self_attn.output(out), stream)
        return self.mlp(h), stream


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (HF's `model.` prefix); under
    pipeline parallelism only what `stage` holds (`layers[i]` is global layer
    `stage.layers[i]`)."""

    def __init__(self, config: ModelConfig, make_mlp: MakeMLP, tp: TPGroup = SINGLE_RANK,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        self.stage = stage or PipelineStage.whole(config.num_layers)
        self.embed_tokens = (vocab_embedding(config.vocab_size, config.hidden_size, tp)
                             if self.stage.is_first else None)
        self.layers = nn.ModuleList(
            DecoderLayer(config, make_mlp(config, tp), tp) for _ in self.stage.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.stage.is_last \
            else None
        # One table for all layers: it is max_model_len x head_dim floats.
        self.rotary = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta,
                                      config.rope_scaling)
        # each row-parallel projection's all-reduce moves into the residual norm after it:
        # o_proj's into post_attention_layernorm, a dense down_proj's into the next layer's
        # input norm or the final norm (one on this stage: the last layer of an earlier
        # stage sends its activations summed)
        layers = self.decoder_layers()
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        for layer, next_norm in zip(layers, next_norms, strict=True):
            sum_in_next_norm(layer.self_attn.o_proj, layer.post_attention_layernorm)
            if isinstance(layer.mlp, MLP) and next_norm is not None:
                sum_in_next_norm(layer.mlp.down_proj, next_norm)

    def decoder_layers(self) -> list[DecoderLayer]:
        """Gives the layers typed as what they are (iterating nn.ModuleList gives Modules)."""
        return [layer for layer in self.layers if isinstance(layer, DecoderLayer)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """Gives the final hidden states of the whole model (a single stage)."""
        assert self.embed_tokens is not None and self.norm is not None  # the single stage
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, kv_cache, meta, backend)
        return self.norm(x, residual)[0]

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                      backend: AttentionBackend, received: Intermediate | None
                      ) -> Intermediate | torch.Tensor:
        """Gives this stage's output: the activations for the next stage, or on the last
        stage the final hidden states. `received`: the previous stage's (None on the first)."""
        if received is None:
            assert self.embed_tokens is not None  # the first stage embeds
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = received.hidden, received.residual
        rope = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(rope, x, residual, kv_cache, meta, backend)
        assert residual is not None  # every stage holds at least one layer
        if self.norm is None:
            return Intermediate(x, residual)
        return self.norm(x, residual)[0]


def dense_mlp(config: ModelConfig, tp: TPGroup) -> MLP:
    """Gives the dense SwiGLU MLP of one layer (this rank's slice)."""
    return MLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM; also serves Mistral, Qwen2 and Qwen3 through config flags."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend | None = None,
                 make_mlp: MakeMLP = dense_mlp, tp: TPGroup = SINGLE_RANK,
                 stage: PipelineStage | None = None) -> None:
        super().__init__()
        if attn_backend is None:
            from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
            attn_backend = TorchAttentionBackend()
        self.config = config
        self.tp = tp
        self.attn_backend = attn_backend
        self.model = DecoderModel(config, make_mlp, tp, stage)
        self.stage = self.model.stage
        self.lm_head = lm_head(config.vocab_size, config.hidden_size, tp) \
            if self.stage.is_last else None
        embed = self.model.embed_tokens
        if config.tie_word_embeddings and self.lm_head is not None and embed is not None:
            self.lm_head.weight = embed.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Gives the final hidden states [T, hidden] of the flat batch `input_ids` [T]."""
        return self.model(input_ids, positions, kv_caches, meta, self.attn_backend)

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                      received: Intermediate | None) -> Intermediate | torch.Tensor:
        """Gives this pipeline stage's output (see `DecoderModel.forward_stage`)."""
        return self.model.forward_stage(input_ids, positions, kv_caches, meta,
                                        self.attn_backend, received)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gives logits [N, vocab] in the model's dtype for the hidden states [N, hidden] to
        sample from (on tensor-parallel rank 0; the other ranks get their vocabulary slice's).
        Not widened to float32 here: the fused sampler widens each logit as it loads it, and
        every other consumer widens its own rows (a float32 copy of 256 rows of a 152k
        vocabulary is 60 us of a ~7 ms decode step on an H100)."""
        assert self.lm_head is not None  # only the last pipeline stage computes logits
        return self.lm_head(hidden)

    def weight_layout(self) -> WeightLayout:
        """Gives where (this rank's slice of) every tensor of an HF checkpoint this stage
        holds lands; `other_stage` names the tensors another stage holds."""
        embed_name, head = "model.embed_tokens.weight", self.lm_head
        layout: WeightLayout = {}
        if self.model.embed_tokens is not None:
            layout |= _vocab_layout(self.model.embed_tokens, embed_name, embed_name)
        elif head is not None and self.config.tie_word_embeddings:
            # a last stage without the embedding reads its tied head from the embedding
            layout |= _vocab_layout(head, embed_name, "lm_head.weight")
        if self.model.norm is not None:
            layout |= whole("model.norm.weight", self.model.norm.weight)
        if head is not None and not self.config.tie_word_embeddings:
            layout |= _vocab_layout(head, "lm_head.weight", "lm_head.weight")
        for local, (i, layer) in enumerate(zip(self.stage.layers, self.model.decoder_layers(),
                                               strict=True)):
            prefix = f"model.layers.{i}"
            layer_layout: WeightLayout = {}
            for name, norm in (("input_layernorm", layer.input_layernorm),
                               ("post_attention_layernorm", layer.post_attention_layernorm)):
                layer_layout |= whole(f"{prefix}.{name}.weight", norm.weight)
            layer_layout |= _attention_layout(f"{prefix}.self_attn", layer.self_attn)
            layer_layout |= layer.mlp.weight_layout(prefix)
            if local != i:  # the checkpoint's global layer index, this stage's local one
                layer_layout = {name: _to_local(slot, prefix, f"model.layers.{local}")
                                for name, slot in layer_layout.items()}
            layout |= layer_layout
        return layout

    def other_stage(self, name: str) -> bool:
        """Gives whether checkpoint tensor `name` belongs to another pipeline stage."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) not in self.stage.layers
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is None and not (
                self.config.tie_word_embeddings and self.lm_head is not None)
        if name.startswith(("model.norm.", "lm_head.")):
            return self.lm_head is None
        return False


def _vocab_layout(module: nn.Embedding | nn.Linear | VocabShard, name: str,
                  param: str) -> WeightLayout:
    if isinstance(module, VocabShard):
        return module.weight_layout(name, param)
    return {name: WeightSlot(param, tuple(module.weight.shape))}


def _to_local(slot: WeightSlot, prefix: str, local_prefix: str) -> WeightSlot:
    """Gives `slot` landing in this stage's local layer instead of the global one."""
    if slot.param is None or not slot.param.startswith(prefix + "."):
        return slot
    return replace(slot, param=local_prefix + slot.param[len(prefix):])


def _attention_layout(prefix: str, attn: Attention) -> WeightLayout:
    layout = attn.qkv_proj.weight_layout(prefix, "qkv_proj", ["q_proj", "k_proj", "v_proj"])
    layout |= linear_layout(f"{prefix}.o_proj", attn.o_proj)
    for name, norm in (("q_norm", attn.q_norm), ("k_norm", attn.k_norm)):
        if norm is not None:
            layout |= whole(f"{prefix}.{name}.weight", norm.weight)
    return layout
