"""The weight layout of each tensor-parallel rank: its slices tile its parameters, together
they read every checkpoint element, and dummy weights are slices of the one full model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.layers import RMSNorm
from kvpilot.engine.models.loader import init_dummy_weights
from kvpilot.engine.models.parallel_layers import RowParallelLinear, VocabShard
from kvpilot.engine.models.registry import model_class
from kvpilot.engine.parallel.groups import TPGroup
from kvpilot.engine.parallel.stage import PipelineStage

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM"]


def build(hf: dict, tp: TPGroup):
    config = ModelConfig.from_hf(hf)
    return model_class(config.architecture)(config, tp=tp)


@given(arch=st.sampled_from(ARCHS), kv_heads=st.sampled_from([1, 2, 4]),
       size=st.sampled_from([2, 4]), whole_experts=st.booleans(), tied=st.booleans(),
       bias=st.booleans())
@settings(max_examples=25, deadline=None)
def test_rank_slices_tile_the_model(arch, kv_heads, size, whole_experts, tied, bias):
    # a vocabulary of 30 does not divide by 4: the last rank's rows are padded
    hf = {"architectures": [arch], "vocab_size": 30, "hidden_size": 16,
          "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": kv_heads, "max_position_embeddings": 64,
          "tie_word_embeddings": tied, "attention_bias": bias, "mlp_bias": bias,
          "num_local_experts": 4, "num_experts_per_tok": 2}
    ep = size if whole_experts and arch == "MixtralForCausalLM" else 1
    full = build(hf, TPGroup())
    init_dummy_weights(full, seed=3)
    full_params = dict(full.named_parameters())
    full_layout = full.weight_layout()
    read = {name: torch.zeros(slot.shape) for name, slot in full_layout.items()}
    for rank in range(size):
        model = build(hf, TPGroup(rank, size, ep))
        init_dummy_weights(model, seed=3)
        params = dict(model.named_parameters())
        coverage = {name: torch.zeros_like(p) for name, p in params.items()}
        layout = model.weight_layout()
        assert set(layout) == set(full_layout)  # every rank knows every checkpoint tensor
        for name, slot in layout.items():
            assert slot.shape == full_layout[name].shape
            if slot.param is None:
                continue  # another rank's expert
            read[name][slot.source] += 1
            coverage[slot.param][slot.index] += 1
            # the rank's dummy weights are the full model's, sliced
            want = full_params[full_layout[name].param][full_layout[name].index][slot.source]
            assert torch.equal(params[slot.param][slot.index], want), name
        for name, count in coverage.items():
            module = model.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(module, VocabShard):  # padding rows beyond the vocabulary: unread
                rows = module.vocab_end - module.vocab_start
                assert torch.all(count[rows:] == 0) and torch.all(params[name][rows:] == 0)
                count = count[:rows]
            assert torch.all(count == 1), (rank, name)
    for name, count in read.items():
        assert torch.all(count >= 1), name  # no checkpoint element is left unread


@pytest.mark.parametrize(("kv_heads", "size", "expected"), [
    (2, 2, [slice(0, 1), slice(1, 2)]),
    (2, 4, [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]),  # replicated twice
    (8, 4, [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]),
])
def test_kv_heads_per_rank(kv_heads, size, expected):
    assert [TPGroup(r, size).kv_heads(kv_heads) for r in range(size)] == expected


@pytest.mark.parametrize(("size", "ep", "experts", "rows"), [
    (2, 1, [slice(0, 8)] * 2, [slice(0, 64), slice(64, 128)]),  # every expert sharded
    (2, 2, [slice(0, 4), slice(4, 8)], [slice(0, 128)] * 2),  # whole experts per rank
    (4, 4, [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)], [slice(0, 128)] * 4),
])
def test_experts_per_rank(size, ep, experts, rows):
    groups = [TPGroup(r, size, ep) for r in range(size)]
    assert [g.experts(8) for g in groups] == experts
    assert [g.expert_rows(128) for g in groups] == rows


@pytest.mark.parametrize("ep", [1, 2], ids=["ep1-sliced-experts", "ep2-whole-experts"])
def test_sharded_moe_dense_path_sums_to_the_full_mixture(ep):
    """The graph-safe MoE path (every local expert on every token, no host sync): the
    ranks' partial outputs, summed as the all-reduce does, give the full mixture."""
    hf = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32, "hidden_size": 16,
          "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64,
          "num_local_experts": 4, "num_experts_per_tok": 2}
    full = build(hf, TPGroup())
    init_dummy_weights(full, seed=1)
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(0))
    moe = full.model.decoder_layers()[0].mlp
    want = moe(x)
    weights, experts = moe.route(x)
    total = torch.zeros_like(x)
    for rank in range(2):
        shard = build(hf, TPGroup(rank, 2, ep))
        init_dummy_weights(shard, seed=1)
        total += shard.model.decoder_layers()[0].mlp._dense(x, weights, experts)
    torch.testing.assert_close(total, want)


@pytest.mark.parametrize(("arch", "stage", "bias"), [
    ("LlamaForCausalLM", None, False),
    ("LlamaForCausalLM", PipelineStage.of(3, 2, 0), False),  # an earlier stage: sends summed
    ("LlamaForCausalLM", PipelineStage.of(3, 2, 1), False),
    ("LlamaForCausalLM", None, True),  # biases are added after the sum: no deferral
    ("MixtralForCausalLM", None, False),  # the MoE block sums its own output
])
def test_each_row_parallel_sum_moves_into_the_norm_after_it(arch, stage, bias):
    hf = {"architectures": [arch], "vocab_size": 32, "hidden_size": 16,
          "intermediate_size": 24, "num_hidden_layers": 3, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "attention_bias": bias,
          "mlp_bias": bias, "num_local_experts": 4, "num_experts_per_tok": 2}
    config = ModelConfig.from_hf(hf)
    tp = TPGroup(0, 2)
    model = model_class(config.architecture)(config, tp=tp, stage=stage).model
    layers = model.decoder_layers()
    summing = [norm for norm in model.modules()
               if isinstance(norm, RMSNorm) and norm.sum_over is not None]
    want: list[RMSNorm] = []
    for i, layer in enumerate(layers):
        o_proj = layer.self_attn.o_proj
        assert isinstance(o_proj, RowParallelLinear) and o_proj.reduce_output == bias
        if not bias:
            want.append(layer.post_attention_layernorm)
        down = getattr(layer.mlp, "down_proj", None)
        if down is None:
            continue  # MoE
        next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        deferred = next_norm is not None and not bias
        assert isinstance(down, RowParallelLinear) and down.reduce_output == (not deferred)
        if deferred:
            want.append(next_norm)
    assert {id(n) for n in summing} == {id(n) for n in want} and all(
        n.sum_over is tp for n in summing)
    assert layers[0].input_layernorm.sum_over is None  # the embedding arrives summed
