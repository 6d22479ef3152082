"""The loader builds every architecture, fills dummy or checkpoint weights, and names
the tensor when a checkpoint and its config disagree."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.paged import BlockAllocation, flat_positions
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.loader import load_model, resolve_load_format

BUILTINS = ["tiny-llama", "tiny-qwen3", "tiny-mixtral"]


def config_of(model: str, **kwargs) -> ModelConfig:
    return ModelConfig.from_engine_args(EngineArgs(model=model, **kwargs), torch.device("cpu"))


def last_logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Gives the logits [B, vocab] of each prompt's last token, from one flat batch."""
    cfg = model.config
    lens = [len(p) for p in prompts]
    alloc = BlockAllocation.shuffled(lens, block_size=8)
    caches = alloc.new_kv_caches(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
    ids = torch.tensor([t for p in prompts for t in p])
    hidden = model(ids, flat_positions(lens, lens), caches, alloc.step(lens, lens))
    last = torch.tensor(lens).cumsum(0) - 1
    return model.compute_logits(hidden[last])


@pytest.mark.parametrize("name", BUILTINS)
def test_dummy_builtin_gives_usable_logits(name):
    model = load_model(config_of(name), "auto", "cpu")
    logits = last_logits(model, [[1, 5, 9, 200], [1, 77], [1, 5, 9, 201]])
    assert logits.shape == (3, 1024) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert logits.std(dim=-1).min() > 1e-3  # not collapsed to a constant
    assert not torch.allclose(logits[0], logits[2])  # the last token matters


def test_dummy_weights_follow_the_seed():
    config = config_of("tiny-llama")
    a, b, c = (load_model(config, "dummy", "cpu", seed=s) for s in (0, 0, 1))
    prompt = [[1, 2, 3, 4, 5]]
    assert torch.equal(last_logits(a, prompt), last_logits(b, prompt))
    assert not torch.allclose(last_logits(a, prompt), last_logits(c, prompt))
    assert a.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.equal(a.model.norm.weight, torch.ones_like(a.model.norm.weight))


@pytest.mark.parametrize(("model", "flag", "expected"), [
    ("tiny-llama", "auto", "dummy"),
    ("tiny-llama", "dummy", "dummy"),
    ("checkpoint", "auto", "safetensors"),
    ("checkpoint", "safetensors", "safetensors"),
    ("checkpoint", "dummy", "dummy"),
    ("empty dir", "dummy", "dummy"),
])
def test_resolve_load_format(tmp_path, tiny_checkpoints, model, flag, expected):
    assert resolve_load_format(model_config(model, tmp_path, tiny_checkpoints), flag) == expected


@pytest.mark.parametrize(("model", "flag", "message"), [
    ("tiny-llama", "safetensors", r"load_format='safetensors' but model='tiny-llama' has no "
                                  r"\*\.safetensors files: .* or pass --load-format dummy"),
    ("empty dir", "auto", r"load_format='auto' but model='.*' has no \*\.safetensors files"),
    ("checkpoint", "pt", r"load_format='pt' is invalid: choose auto, safetensors or dummy"),
])
def test_unloadable_formats_are_clear_errors(tmp_path, tiny_checkpoints, model, flag, message):
    with pytest.raises(ValueError, match=message):
        load_model(model_config(model, tmp_path, tiny_checkpoints), flag, "cpu")


def model_config(model: str, tmp_path, tiny_checkpoints) -> ModelConfig:
    """Gives the config of a built-in name, the llama checkpoint, or a dir with only a
    config.json (as a pytorch_model.bin-only checkpoint looks to the loader)."""
    if model == "checkpoint":
        return config_of(str(tiny_checkpoints("llama")))
    if model == "empty dir":
        shutil.copy(tiny_checkpoints("llama") / "config.json", tmp_path / "config.json")
        return config_of(str(tmp_path))
    return config_of(model)


def test_tied_model_shares_embedding_and_head():
    model = load_model(config_of("tiny-qwen3"), "dummy", "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_attention_backend_can_be_swapped():
    """The runner replaces `model.attn_backend` after loading (e.g. Triton on GPU)."""

    class Counting(TorchAttentionBackend):
        calls = 0

        def forward(self, *args, **kwargs):
            Counting.calls += 1
            return super().forward(*args, **kwargs)

    model = load_model(config_of("tiny-llama"), "dummy", "cpu")
    before = last_logits(model, [[1, 2, 3]])
    model.attn_backend = Counting()
    after = last_logits(model, [[1, 2, 3]])
    assert Counting.calls == model.config.num_layers
    assert torch.equal(before, after)


def copy_checkpoint(src, dst, edit):
    """Copies a one-file checkpoint with its tensors passed through `edit(dict)`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"),
     r"lacks tensor\(s\) the model needs: model\.layers\.1\.self_attn\.k_proj\.weight"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}),
     r"has tensor 'model\.layers\.0\.mlp\.extra\.weight' that LlamaForCausalLM does not use"),
    (lambda t: t.update({"model.norm.weight": torch.ones(65)}),
     r"tensor 'model\.norm\.weight' has shape \(65,\) but config\.json implies \(64,\)"),
])
def test_checkpoint_mismatch_names_the_tensor(tmp_path, tiny_checkpoints, edit, message):
    path = copy_checkpoint(tiny_checkpoints("llama"), tmp_path / "ckpt", edit)
    with pytest.raises(ValueError, match=message):
        load_model(config_of(str(path)), "auto", "cpu")


def test_unknown_architecture_in_checkpoint(tmp_path, tiny_checkpoints):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints("llama"), path)
    hf = json.loads((path / "config.json").read_text())
    hf["architectures"] = ["FalconForCausalLM"]
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"architectures=\['FalconForCausalLM'\] in config\.json"
                                         r" is not supported: kvpilot runs LlamaForCausalLM"):
        config_of(str(path))


def test_extra_rotary_and_tied_head_tensors_are_ignored(tmp_path, tiny_checkpoints):
    """Older checkpoints store rotary inv_freq; tied ones sometimes store lm_head too."""

    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    path = copy_checkpoint(tiny_checkpoints("llama-tied"), tmp_path / "ckpt", edit)
    model = load_model(config_of(str(path)), "auto", "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_consolidated_file_beside_model_file_is_not_read(tmp_path, tiny_checkpoints):
    """Mistral repos ship consolidated.safetensors (other tensor names) next to the HF files."""
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints("mistral"), path)
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, path / "consolidated.safetensors")
    model = load_model(config_of(str(path)), "auto", "cpu")
    assert model.config.architecture == "MistralForCausalLM"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-mixtral"])
def test_kernel_seams_take_the_kernels_signatures(name):
    """The seams call kvpilot.kernels' ops by their signatures; their torch references
    stand in for the Triton kernels here, so the output must not change."""
    from kvpilot.engine.models.layers import RMSNorm
    from kvpilot.engine.models.rope import RotaryEmbedding
    from kvpilot.kernels.activation import silu_and_mul_ref
    from kvpilot.kernels.rmsnorm import rms_norm_ref
    from kvpilot.kernels.rotary import rotary_embedding_ref

    model = load_model(config_of(name), "dummy", "cpu")
    prompts = [[1, 5, 9, 200, 7], [1, 77, 3]]
    before = last_logits(model, prompts)
    calls = {"norm": 0, "rotary": 0, "act": 0}

    def counted(key, op):
        def run(*args):
            calls[key] += 1
            return op(*args)
        return run

    seams = {RMSNorm: ("kernel", counted("norm", rms_norm_ref)),
             RotaryEmbedding: ("kernel", counted("rotary", rotary_embedding_ref))}
    for module in model.modules():
        attr, op = seams.get(type(module), ("act", counted("act", silu_and_mul_ref)))
        if hasattr(module, attr):
            setattr(module, attr, op)
    torch.testing.assert_close(last_logits(model, prompts), before, rtol=1e-5, atol=1e-5)
    layers = model.config.num_layers
    norms_per_layer = 4 if model.config.qk_norm else 2
    assert (calls["norm"], calls["rotary"]) == (layers * norms_per_layer + 1, layers)
    # dense: one activation per layer; MoE: one per expert that got tokens
    assert calls["act"] == layers if model.config.num_experts == 0 else calls["act"] > layers


def test_graph_safe_moe_path_equals_sparse_path():
    """The dense path Mixtral takes under CUDA-graph capture gives the same output."""
    model = load_model(config_of("tiny-mixtral"), "dummy", "cpu")
    moe = model.model.layers[0].mlp
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, experts = moe.route(x)
    assert experts.unique().numel() > 1
    torch.testing.assert_close(moe._dense(x, weights, experts), moe(x), rtol=1e-6, atol=1e-7)


def test_untied_head_in_a_tied_config_is_a_clear_error(tmp_path, tiny_checkpoints):
    """A config.json that omits tie_word_embeddings means tied (HF's default); a checkpoint
    with a different lm_head must not be silently served with the embedding instead."""
    path = copy_checkpoint(tiny_checkpoints("llama"), tmp_path / "ckpt", lambda t: None)
    hf = json.loads((path / "config.json").read_text())
    del hf["tie_word_embeddings"]
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=r"has its own lm_head\.weight, but config\.json ties"):
        load_model(config_of(str(path)), "auto", "cpu")


@given(
    arch=st.sampled_from(["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                          "MixtralForCausalLM"]),
    kv_heads=st.sampled_from([1, 2, 4]),
    layers=st.integers(1, 3),
    experts=st.integers(1, 4),
    tied=st.booleans(),
    bias=st.booleans(),
)
@settings(max_examples=25, deadline=None)
def test_weight_layout_covers_every_parameter_element_once(arch, kv_heads, layers, experts,
                                                           tied, bias):
    """Invariant of the loader's table: checkpoint tensors tile each parameter exactly, so
    a complete checkpoint leaves nothing unset and nothing written twice."""
    from kvpilot.engine.models.registry import model_class

    hf = {"architectures": [arch], "vocab_size": 32, "hidden_size": 16,
          "intermediate_size": 24, "num_hidden_layers": layers, "num_attention_heads": 4,
          "num_key_value_heads": kv_heads, "max_position_embeddings": 64,
          "tie_word_embeddings": tied, "attention_bias": bias, "mlp_bias": bias,
          "num_local_experts": experts, "num_experts_per_tok": 1}
    config = ModelConfig.from_hf(hf)
    model = model_class(arch)(config)
    coverage = {name: torch.zeros_like(p) for name, p in model.named_parameters()}
    for slot in model.weight_layout().values():
        assert slot.param is not None and slot.source == ()  # one rank holds everything
        coverage[slot.param][slot.index] += 1
    for name, count in coverage.items():
        assert torch.all(count == 1), name
