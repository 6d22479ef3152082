"""Writes pre-quantised copies of a tiny HF checkpoint in the layouts other tools write:
HF/vLLM `quant_method: fp8` and `compressed-tensors` (fp8 or int8), per-channel
([out, 1]) or per-tensor (scalar) `weight_scale`.

    path = write_quantized(src, tmp_path / "fp8", "fp8", "channel")
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvpilot.engine.quantization.methods import METHODS

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_quantized(src: Path, dst: Path, method: str, strategy: str,
                    fmt: str = "fp8") -> Path:
    """Gives `dst`: `src` with its projection weights in `method` (fp8 or int8) with
    `strategy` (channel or tensor) scales, its config.json saying so in `fmt`
    (fp8: HF/vLLM's, or compressed-tensors)."""
    quant = METHODS[method]
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(str(file))
        out = {}
        for name, tensor in tensors.items():
            if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
                weight, scale = quantize(quant, tensor, strategy)
                out[name], out[f"{name}_scale"] = weight, scale
            else:
                out[name] = tensor
        save_file(out, str(file), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, strategy, fmt)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def quantize(quant, weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Gives (8-bit weight, scale [out, 1] per channel or [] per tensor)."""
    if strategy == "channel":
        q, scale = quant.quantize(weight)
        return q, scale[:, None]
    scale = weight.float().abs().max() / quant.max_value
    return quant.cast(weight.float() / scale), scale


def quantization_config(method: str, strategy: str, fmt: str) -> dict:
    """Gives the `quantization_config` a tool writes for these weights."""
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    weights = {"num_bits": 8, "type": "float" if method == "fp8" else "int",
               "symmetric": True, "strategy": strategy, "dynamic": False}
    acts = ({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
             "dynamic": True} if method == "fp8" else None)
    return {"quant_method": "compressed-tensors",
            "format": "float-quantized" if method == "fp8" else "int-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}},
            "ignore": ["lm_head"]}
