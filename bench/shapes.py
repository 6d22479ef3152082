"""The model shapes the GPU benchmarks run (config.json contents; dummy weights fill them)."""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64}
# the nano-vllm recipe's model
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
    "attention_bias": False,
}


def write_model_dir(path: Path, config: dict) -> Path:
    """Writes a model dir for `load_format="dummy"`: `config` as config.json and a word-level
    tokenizer over its vocabulary (token i is "t{i}"); gives `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])},
                                     unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def write_random_checkpoint(path: Path, config: dict, seed: int = 0, dtype: str = "bfloat16",
                            device: str = "cpu") -> Path:
    """Writes a model dir that `load_format="auto"` serves (what `kvpilot up --model-dir`
    needs, its manifest naming no built-in config): `config` as config.json, the bundled
    tiny tokenizer (so `config` must use its vocabulary) and a one-file safetensors
    checkpoint of N(0, 0.02) tensors (norms: ones), named and shaped as the engine's own
    model class loads them; gives `path`."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from kvpilot.engine.contracts.builtin_models import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
    from kvpilot.engine.models.config import ModelConfig
    from kvpilot.engine.models.registry import model_class

    model_config = ModelConfig.from_hf(config, dtype=getattr(torch, dtype))
    with torch.device("meta"):  # only the names and shapes: nothing is allocated
        layout = model_class(model_config.architecture)(model_config).weight_layout()
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, slot in layout.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(slot.shape, dtype=model_config.dtype)
        else:
            tensors[name] = torch.empty(slot.shape, dtype=model_config.dtype, device=device
                                        ).normal_(0.0, 0.02, generator=generator).cpu()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    shutil.copy(TOKENIZER_FILE, path / "tokenizer.json")
    shutil.copy(TOKENIZER_CONFIG_FILE, path / "tokenizer_config.json")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
