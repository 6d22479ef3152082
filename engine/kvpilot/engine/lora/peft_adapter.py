"""Reads a PEFT LoRA adapter dir (`adapter_config.json` + `adapter_model.safetensors`) into
per-projection A/B matrices on the host, refusing what the engine cannot serve.

PEFT names a tensor `base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>
.weight`: A is [r, in], B is [out, r], and the delta of a projection is scale * x A^T B^T
with scale = lora_alpha / r (lora_alpha / sqrt(r) under rsLoRA).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvpilot.engine.contracts.lora import LORA_TARGET_MODULES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class PeftAdapter:
    """One adapter on the host: (layer, projection) -> (A [r, in], B [out, r]) in float32."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _refuse(name: str, path: str, what: str, fix: str) -> ValueError:
    return ValueError(f"LoRA adapter {name!r} at {path!r}: {what}: {fix}")


def _targets(name: str, path: str, config: dict) -> list[str]:
    targets = config.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise _refuse(name, path, f"target_modules={targets!r} is not a list of projections",
                      f"train it with target_modules among {', '.join(LORA_TARGET_MODULES)}")
    unsupported = sorted(set(targets) - set(LORA_TARGET_MODULES))
    if unsupported:
        raise _refuse(name, path, f"target_modules {unsupported} are not supported",
                      f"target only {', '.join(LORA_TARGET_MODULES)}")
    return list(targets)


def _check_config(name: str, path: str, config: dict, max_rank: int) -> None:
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(name, path, f"r={rank!r} is invalid", "r must be a positive integer")
    if rank > max_rank:
        raise _refuse(name, path, f"r={rank} exceeds max_lora_rank={max_rank}",
                      f"start the engine with --max-lora-rank {rank} or more")
    for key, allowed, fix in (
            ("use_dora", (False, None), "DoRA adapters are not supported; use plain LoRA"),
            ("bias", ("none", None), "use bias='none'"),
            ("modules_to_save", (None, []), "drop modules_to_save (only LoRA weights are read)"),
            ("rank_pattern", ({}, None), "use one rank for every module"),
            ("alpha_pattern", ({}, None), "use one lora_alpha for every module"),
            ("layers_to_transform", (None, []), "adapt every layer"),
            ("fan_in_fan_out", (False, None), "use fan_in_fan_out=False (Llama's layout)")):
        if config.get(key) not in allowed:
            raise _refuse(name, path, f"{key}={config.get(key)!r} is not supported", fix)


def load_peft_adapter(name: str, path: str, max_rank: int) -> PeftAdapter:
    """Gives the adapter at `path`; raises ValueError naming the adapter, the file or field
    and the fix when the dir is missing, malformed or asks for what is not supported."""
    from safetensors.torch import load_file

    root = Path(path)
    if not (root / CONFIG_FILE).is_file() or not (root / WEIGHTS_FILE).is_file():
        raise _refuse(name, path, f"no {CONFIG_FILE} and {WEIGHTS_FILE} there",
                      "give the dir PEFT's save_pretrained wrote")
    config = json.loads((root / CONFIG_FILE).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(name, path, f"peft_type={config.get('peft_type')!r} is not LoRA",
                      "give a LoRA adapter")
    _check_config(name, path, config, max_rank)
    targets = _targets(name, path, config)
    rank, alpha = config["r"], config.get("lora_alpha", config["r"])
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in load_file(str(root / WEIGHTS_FILE)).items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in targets:
            raise _refuse(name, path, f"tensor {key!r} is not a LoRA weight of a targeted "
                          "projection", "save only LoRA weights of q/k/v/o/gate/up/down")
        halves[(int(match.group(1)), match.group(2), match.group(3))] = tensor.float()
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj, half), tensor in halves.items():
        if half != "A":
            continue
        b = halves.get((layer, proj, "B"))
        if b is None or tensor.shape[0] != rank or b.shape[1] != rank:
            raise _refuse(name, path, f"layer {layer} {proj}: lora_A {tuple(tensor.shape)} and "
                          f"lora_B {None if b is None else tuple(b.shape)} do not match r={rank}",
                          "re-save the adapter with PEFT")
        weights[(layer, proj)] = (tensor, b)
    if not weights:
        raise _refuse(name, path, f"{WEIGHTS_FILE} holds no LoRA weights", "re-save it with PEFT")
    return PeftAdapter(name, path, rank, scale, weights)
