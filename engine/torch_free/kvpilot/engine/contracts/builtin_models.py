"""Built-in tiny model configs that run with no files at all (random `dummy` weights).

Each entry is written the way an HF `config.json` would be, so built-in and
on-disk models go through the same parser. They share the bundled tiny
tokenizer in `assets/`, so the vocabulary size is that tokenizer's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ASSETS = Path(__file__).parent / "assets"
TOKENIZER_FILE = ASSETS / "tiny-tokenizer.json"
TOKENIZER_CONFIG_FILE = ASSETS / "tokenizer_config.json"

# Token ids of the bundled tokenizer's special tokens (fixed by the training script).
ENDOFTEXT_ID, BOS_ID, IM_START_ID, IM_END_ID, PAD_ID = 0, 1, 2, 3, 4
TINY_VOCAB_SIZE = 1024

_COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": [ENDOFTEXT_ID, IM_END_ID],
}

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "tiny-qwen3": {**_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                   "tie_word_embeddings": True},
    "tiny-mixtral": {**_COMMON, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                     "intermediate_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2},
}


def is_builtin(name: str) -> bool:
    """Gives whether `name` is a built-in tiny config rather than a path."""
    return name in BUILTIN_CONFIGS
