"""The model's shape and settings, parsed from an HF `config.json` or a built-in tiny config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.builtin_models import BUILTIN_CONFIGS, is_builtin

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    """Everything the model code, the KV cache sizing and the sampler need to know."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    num_experts: int
    num_experts_per_tok: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    dtype: torch.dtype
    max_model_len: int
    model_path: str | None
    name: str
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2, some Llamas)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm on q and k before rope (Qwen3)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, device: torch.device) -> ModelConfig:
        """Gives the config of `args.model` (a built-in name or an HF directory) on `device`."""
        if is_builtin(args.model):
            hf, path = dict(BUILTIN_CONFIGS[args.model]), None
        else:
            path = Path(args.model)
            hf = read_hf_config(path)
        dtype = resolve_dtype(args.dtype, torch.device(device))
        return cls.from_hf(hf, dtype=dtype, max_model_len=args.max_model_len,
                           model_path=None if path is None else str(path), name=args.name)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, dtype: torch.dtype = torch.float32,
                max_model_len: int | None = None, model_path: str | None = None,
                name: str = "model") -> ModelConfig:
        """Gives the config described by the HF `config.json` dict `hf`."""
        architecture = _architecture(hf)
        num_heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _rope(hf)
        max_positions = hf.get("max_position_embeddings", 2048)
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        # The attention backends attend over the whole context, so a sliding-window
        # model is only exact while sequences fit in its window.
        model_limit = min(max_positions, window) if window else max_positions
        if max_model_len is not None and max_model_len > model_limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's limit {model_limit} "
                "(max_position_embeddings, or sliding_window when set): pass a smaller "
                "--max-model-len")
        is_moe = architecture == "MixtralForCausalLM"
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            intermediate_size=hf["intermediate_size"],
            max_position_embeddings=max_positions,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # HF's PretrainedConfig defaults to tied embeddings when the key is absent.
            tie_word_embeddings=hf.get("tie_word_embeddings", True),
            num_experts=hf.get("num_local_experts", 0) if is_moe else 0,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if is_moe else 0,
            eos_token_ids=_as_list(hf.get("eos_token_id")),
            bos_token_id=hf.get("bos_token_id"),
            dtype=dtype,
            max_model_len=max_model_len or model_limit,
            model_path=model_path,
            name=name,
            attention_bias=architecture == "Qwen2ForCausalLM" or hf.get("attention_bias", False),
            # Qwen2 biases q/k/v only; Llama's attention_bias covers o_proj too.
            o_proj_bias=architecture != "Qwen2ForCausalLM" and hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
            qk_norm=architecture == "Qwen3ForCausalLM",
            hf_config=hf,
        )


def read_hf_config(path: Path) -> dict[str, Any]:
    """Gives `config.json` of the model dir, with EOS ids merged from `generation_config.json`."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"model={str(path)!r} is neither a built-in config ({', '.join(BUILTIN_CONFIGS)}) "
            f"nor a directory with config.json: pass an HF model directory or a built-in name")
    hf = json.loads(config_file.read_text())
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        # Instruct models list their end-of-turn token here rather than in config.json.
        extra = json.loads(generation_file.read_text()).get("eos_token_id")
        if extra is not None:
            ids = _as_list(hf.get("eos_token_id")) + _as_list(extra)
            hf["eos_token_id"] = list(dict.fromkeys(ids))
    return hf


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Gives the torch dtype for the `--dtype` flag: auto is bfloat16 on CUDA, float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def _as_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _architecture(hf: dict[str, Any]) -> str:
    names = hf.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    raise ValueError(
        f"architectures={names!r} in config.json is not supported: kvpilot runs "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Gives (rope_theta, rope_scaling) from either the classic keys or transformers 5's
    `rope_parameters`; default rope gives no scaling dict."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    scaling = dict(hf.get("rope_scaling") or {}) or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    scaling["rope_type"] = rope_type
    return float(theta), scaling
