"""Writes tiny random-weight HF checkpoints with `transformers`, for tests of every area.

    from helpers.checkpoints import write_checkpoint
    path = write_checkpoint(tmp_path, "llama")                  # fp32, one file
    path = write_checkpoint(tmp_path, "qwen3", max_shard_size="100KB")  # sharded

Each dir holds config.json, generation_config.json, *.safetensors and the bundled
tiny tokenizer (tokenizer.json + tokenizer_config.json with a chat template), so
both `kvpilot.engine.contracts.tokenizer.load_tokenizer(dir)` and HF `AutoTokenizer` load it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from kvpilot.engine.contracts.builtin_models import (
    BOS_ID,
    ENDOFTEXT_ID,
    TINY_VOCAB_SIZE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)

_SHAPE: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": BOS_ID,
    "eos_token_id": ENDOFTEXT_ID,
    "tie_word_embeddings": False,
}

# family -> (transformers config class name, settings on top of _SHAPE)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    # Llama 3.1's rope scaling; a small original length so the stretch matters at test lengths.
    "llama3": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama-tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    # Llama's optional biases: q/k/v/o (attention_bias) and the MLP's (mlp_bias)
    "llama-bias": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralConfig", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": None}),
}


def hf_config(family: str, **overrides: Any):
    """Gives the transformers config object of a tiny model of `family`."""
    import transformers

    class_name, settings = FAMILIES[family]
    return getattr(transformers, class_name)(**{**_SHAPE, **settings, **overrides})


def write_checkpoint(root: Path, family: str, *, seed: int = 0,
                     max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Gives the dir `root/family` holding a freshly written tiny fp32 checkpoint."""
    from transformers import AutoModelForCausalLM

    path = Path(root) / family
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides),
                                             dtype=torch.float32)
    _perturb_init_constants(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    write_tokenizer(path)
    return path


def _perturb_init_constants(model: torch.nn.Module) -> None:
    """HF initialises norms to ones and biases to zeros; jitter them so a model that
    skips a bias or a norm weight cannot still match."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith(".bias"):
                param.copy_(torch.randn_like(param) * 0.02)


def write_tokenizer(path: Path) -> None:
    """Copies the bundled tiny tokenizer files into the model dir `path`."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(TOKENIZER_FILE, path / "tokenizer.json")
    shutil.copy(TOKENIZER_CONFIG_FILE, path / "tokenizer_config.json")


def load_hf_model(path: Path):
    """Gives the HF reference model of a written checkpoint, fp32, eager attention, eval."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")
    return model.eval()
