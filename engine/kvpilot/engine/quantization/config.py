"""Which 8-bit format a model runs (and its KV cache's dtype): from `--quantization` (quantised at load time) or from
a pre-quantised checkpoint's `config.json` `quantization_config`, and where it can run.

Pre-quantised checkpoints read: HF/vLLM `quant_method: fp8` (dynamic activation scheme,
per-channel or per-tensor `weight_scale`) and `compressed-tensors` (float-quantized fp8
with dynamic activations, or int-quantized int8 weight-only; channel or tensor
strategy). Anything else is refused, naming the field and the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.engine.quantization.methods import METHODS, QuantMethod
from kvpilot.kernels.kv_cache_dtype import FP8_KV_DTYPE

_FIX = ("kvpilot reads 8-bit per-channel or per-tensor fp8/compressed-tensors checkpoints: "
        "serve the bf16 checkpoint with --quantization int8 or fp8 instead")
_HEAD_ONLY = {"lm_head", "re:.*lm_head"}


@dataclass(frozen=True)
class QuantConfig:
    """The format the projection layers run in; `prequantized`: the checkpoint holds the
    8-bit weights and their `weight_scale` tensors (else they are quantised at load)."""

    method: QuantMethod
    prequantized: bool


def resolve_quantization(flag: str, hf_config: dict[str, Any],
                         architecture: str) -> QuantConfig | None:
    """Gives the quantisation of a model (None: unquantised); raises ValueError naming
    the field when the checkpoint's layout is not supported or disagrees with `flag`."""
    found = checkpoint_method(hf_config.get("quantization_config"))
    if found is None:
        return None if flag == "none" else QuantConfig(METHODS[flag], prequantized=False)
    if flag not in ("none", found):
        raise ValueError(f"quantization={flag!r} but the checkpoint is already quantised to "
                         f"{found} (config.json quantization_config): drop --quantization "
                         f"or pass --quantization {found}")
    if architecture == "MixtralForCausalLM":
        raise ValueError("a pre-quantised MixtralForCausalLM checkpoint is not supported "
                         "(its experts stay in the model dtype here): serve the bf16 "
                         "checkpoint with --quantization int8 or fp8")
    return QuantConfig(METHODS[found], prequantized=True)


def checkpoint_method(qc: dict[str, Any] | None) -> str | None:
    """Gives the method ('fp8' or 'int8') of a `quantization_config`, None when there is none."""
    if qc is None:
        return None
    kind = qc.get("quant_method")
    if kind == "fp8":
        return _fp8_method(qc)
    if kind == "compressed-tensors":
        return _compressed_tensors_method(qc)
    raise ValueError(f"quantization_config.quant_method={kind!r} is not supported: {_FIX}")


def _fp8_method(qc: dict[str, Any]) -> str:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme="
                         f"{qc['activation_scheme']!r} is not supported (activations are "
                         f"scaled per token at run time): {_FIX}")
    if qc.get("weight_block_size"):
        raise ValueError(f"quantization_config.weight_block_size={qc['weight_block_size']!r} "
                         f"(block-wise scales) is not supported: {_FIX}")
    for key in ("ignored_layers", "modules_to_not_convert"):
        _check_ignored(key, qc.get(key) or [])
    return "fp8"


def _compressed_tensors_method(qc: dict[str, Any]) -> str:
    if qc.get("kv_cache_scheme"):
        raise ValueError("quantization_config.kv_cache_scheme is set: an fp8 KV cache is not "
                         f"supported: {_FIX}")
    _check_ignored("ignore", qc.get("ignore") or [])
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1 or groups[0].get("targets") != ["Linear"]:
        raise ValueError("quantization_config.config_groups must be one group targeting "
                         f"['Linear'], not {qc.get('config_groups')!r}: {_FIX}")
    weights, acts = groups[0].get("weights") or {}, groups[0].get("input_activations")
    wanted = (weights.get("num_bits"), weights.get("symmetric", True),
              weights.get("strategy"), weights.get("dynamic", False))
    if wanted not in ((8, True, "channel", False), (8, True, "tensor", False)):
        raise ValueError(f"quantization_config weights={weights!r} is not supported (8-bit, "
                         f"symmetric, channel or tensor strategy, static): {_FIX}")
    if weights.get("type") == "float" and acts and acts.get("type") == "float" \
            and acts.get("num_bits") == 8 and acts.get("dynamic"):
        return "fp8"
    if weights.get("type") == "int" and acts is None:
        return "int8"
    raise ValueError(f"quantization_config weights type={weights.get('type')!r} with "
                     f"input_activations={acts!r} is not supported (fp8 weights with dynamic "
                     f"fp8 activations, or int8 weights alone): {_FIX}")


def _check_ignored(key: str, ignored: list[str]) -> None:
    extra = sorted(set(ignored) - _HEAD_ONLY)
    if extra:
        raise ValueError(f"quantization_config.{key} lists {extra!r}: only the LM head may be "
                         f"left unquantised here: {_FIX}")


# why fp8 is refused on AMD GPUs: the kernels and the cache use OCP's E4M3 (float8_e4m3fn),
# while an MI300X's (gfx942) fp8 units compute E4M3FNUZ, and none of it has run on one
ROCM_FP8 = ("has not run on ROCm GPUs (the kernels use OCP E4M3, float8_e4m3fn; an MI300X's "
            "fp8 is E4M3FNUZ)")


def resolve_kv_cache_dtype(choice: str, model_dtype: torch.dtype,
                           device: torch.device) -> torch.dtype:
    """Gives the KV cache's dtype for `--kv-cache-dtype` (auto: the model's); raises
    ValueError on a GPU whose kernels cannot load fp8 (compute capability below 8.9, or an
    AMD GPU: see `ROCM_FP8`)."""
    if choice == "auto":
        return model_dtype
    if device.type == "cuda" and torch.version.hip is not None:
        raise ValueError(f"kv_cache_dtype='fp8' {ROCM_FP8}: use --kv-cache-dtype auto")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"kv_cache_dtype='fp8' needs compute capability 8.9+ (H100, L4), "
                         f"not {torch.cuda.get_device_name(device)}: use --kv-cache-dtype auto")
    return FP8_KV_DTYPE


def check_device(quant: QuantConfig | None, device: torch.device) -> None:
    """Raises ValueError when `device` cannot run the format (fp8 needs FP8 tensor cores)."""
    if quant is None or quant.method.name != "fp8":
        return
    if device.type == "cuda" and torch.version.hip is not None:
        raise ValueError(f"quantization='fp8' {ROCM_FP8}: use --quantization int8 or serve "
                         "the model unquantised")
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        name = device.type if device.type != "cuda" else torch.cuda.get_device_name(device)
        raise ValueError(f"quantization='fp8' needs a GPU with FP8 tensor cores (compute "
                         f"capability 8.9+, e.g. H100, L4), not {name}: use --quantization "
                         "int8 or serve the model unquantised")
