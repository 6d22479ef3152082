"""ModelConfig parses HF config.json variants and built-in names into one shape."""

from __future__ import annotations

import json

import pytest
import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.models.config import ModelConfig, resolve_dtype

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 512}


@pytest.mark.parametrize(("extra", "field", "expected"), [
    ({}, "num_kv_heads", 4),                       # no num_key_value_heads: plain MHA
    ({"num_key_value_heads": 2}, "num_kv_heads", 2),
    ({}, "head_dim", 16),                          # hidden / heads when absent
    ({"head_dim": None}, "head_dim", 16),          # Mixtral writes null
    ({"head_dim": 32}, "head_dim", 32),
    ({}, "tie_word_embeddings", True),             # HF's default when the key is absent
    ({"eos_token_id": 2}, "eos_token_ids", [2]),
    ({"eos_token_id": [2, 7]}, "eos_token_ids", [2, 7]),
    ({}, "eos_token_ids", []),
    ({"rope_theta": 5e5}, "rope_theta", 5e5),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, "rope_theta", 1e6),
    ({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, "rope_scaling", None),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling",
     {"type": "linear", "factor": 2.0, "rope_type": "linear"}),
    ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}},
     "rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
    ({}, "max_model_len", 512),
    ({"sliding_window": 128}, "max_model_len", 128),  # exact only inside the window
    ({"sliding_window": 128, "use_sliding_window": False}, "max_model_len", 512),
    ({"attention_bias": True}, "o_proj_bias", True),
    ({"architectures": ["Qwen2ForCausalLM"]}, "attention_bias", True),
    ({"architectures": ["Qwen2ForCausalLM"]}, "o_proj_bias", False),
    ({"architectures": ["Qwen3ForCausalLM"]}, "qk_norm", True),
    ({"architectures": ["LlamaForCausalLM"]}, "qk_norm", False),
    ({"num_local_experts": 8}, "num_experts", 0),   # experts count only for MoE archs
    ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
      "num_experts_per_tok": 2}, "num_experts", 8),
])
def test_from_hf_fields(extra, field, expected):
    assert getattr(ModelConfig.from_hf({**BASE, **extra}), field) == expected


@pytest.mark.parametrize(("name", "architecture", "tied", "experts"), [
    ("tiny-llama", "LlamaForCausalLM", False, 0),
    ("tiny-qwen3", "Qwen3ForCausalLM", True, 0),
    ("tiny-mixtral", "MixtralForCausalLM", False, 4),
])
def test_builtin_configs(name, architecture, tied, experts):
    config = ModelConfig.from_engine_args(EngineArgs(model=name), torch.device("cpu"))
    assert (config.architecture, config.tie_word_embeddings, config.num_experts) == (
        architecture, tied, experts)
    assert config.vocab_size == 1024 and config.model_path is None and config.name == name
    assert config.dtype == torch.float32 and config.max_model_len == 4096
    assert config.eos_token_ids == [0, 3]


@pytest.mark.parametrize(("flag", "device", "expected"), [
    ("auto", "cpu", torch.float32),
    ("auto", "cuda", torch.bfloat16),
    ("float16", "cpu", torch.float16),
    ("bfloat16", "cuda", torch.bfloat16),
    ("float32", "cuda", torch.float32),
])
def test_resolve_dtype(flag, device, expected):
    assert resolve_dtype(flag, torch.device(device)) == expected


def test_engine_args_override_length_and_name():
    args = EngineArgs(model="tiny-llama", max_model_len=300, served_model_name="small")
    config = ModelConfig.from_engine_args(args, torch.device("cpu"))
    assert (config.max_model_len, config.name) == (300, "small")


def test_generation_config_eos_ids_are_merged(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    config = ModelConfig.from_engine_args(EngineArgs(model=str(tmp_path)), torch.device("cpu"))
    assert config.eos_token_ids == [2, 9] and config.model_path == str(tmp_path)


@pytest.mark.parametrize(("hf", "max_model_len", "message"), [
    ({**BASE, "architectures": ["GPT2LMHeadModel"]}, None,
     r"architectures=\['GPT2LMHeadModel'\] in config.json is not supported: kvpilot runs "
     r"LlamaForCausalLM, MistralForCausalLM"),
    ({**BASE, "architectures": []}, None, r"architectures=\[\] in config.json"),
    (BASE, 1024, r"max_model_len=1024 exceeds the model's limit 512"),
    ({**BASE, "sliding_window": 100}, 200, r"max_model_len=200 exceeds the model's limit 100"),
])
def test_invalid_configs_name_the_field(hf, max_model_len, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf, max_model_len=max_model_len)


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"neither a built-in config .* nor a directory"):
        ModelConfig.from_engine_args(EngineArgs(model=str(tmp_path / "nope")),
                                     torch.device("cpu"))
