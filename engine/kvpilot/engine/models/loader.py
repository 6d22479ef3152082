"""Builds a model for its config and fills its weights from safetensors or at random."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.fused import use_fused_kernels
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.models.registry import model_class
from kvpilot.engine.startup_log import progress

logger = logging.getLogger(__name__)
DUMMY_STD = 0.02
# Checkpoint tensors that carry no weights the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(config: ModelConfig, load_format: str, device: torch.device | str,
               seed: int = 0, fused_kernels: bool | None = None) -> LlamaForCausalLM:
    """Gives the model for `config` on `device`, in eval mode, weights loaded per
    `load_format` (auto, safetensors or dummy), with the Triton kernels of
    `kvpilot.kernels` in its norm/activation/rotary seams when `fused_kernels`
    (default: on CUDA)."""
    fmt = resolve_load_format(config, load_format)
    device = torch.device(device)
    with _default_dtype(config.dtype), device:
        model = model_class(config.architecture)(config)
    checkpoint = None if fmt == "dummy" else config.model_path  # set for safetensors
    if checkpoint is None:
        init_dummy_weights(model, seed)
    else:
        load_safetensors(model, Path(checkpoint))
    if fused_kernels:
        use_fused_kernels(model)
    elif fused_kernels is None and device.type == "cuda":
        try:
            use_fused_kernels(model)
        except ImportError as exc:  # e.g. a CUDA build without Triton: torch ops still work
            logger.warning("fused kernels unavailable (%s); the model runs torch ops", exc)
    return model.eval().requires_grad_(False)


def resolve_load_format(config: ModelConfig, load_format: str) -> str:
    """Gives `safetensors` or `dummy`: auto means dummy for a built-in config and
    safetensors for a model dir (which must then have them)."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(
            f"load_format={load_format!r} is invalid: choose auto, safetensors or dummy")
    if load_format == "dummy" or (load_format == "auto" and config.model_path is None):
        return "dummy"
    if config.model_path is None or not any(Path(config.model_path).glob("*.safetensors")):
        # A dir holding only pytorch_model.bin lands here too: pickle files are not loaded.
        raise ValueError(
            f"load_format={load_format!r} but model={config.model_path or config.name!r} "
            "has no *.safetensors files: point --model at a directory with them, or pass "
            "--load-format dummy")
    return "safetensors"


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fills every weight with N(0, 0.02) from a generator seeded with `seed` on the weights'
    device (in place, so even a large model needs no extra copy); norm weights get ones,
    as in a freshly initialised HF model."""
    generator = None
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
            continue
        if generator is None:
            generator = torch.Generator(device=param.device).manual_seed(seed)
        param.data.normal_(0.0, DUMMY_STD, generator=generator)


def load_safetensors(model: LlamaForCausalLM, path: Path) -> None:
    """Copies every checkpoint tensor into its place; raises naming any unexpected,
    mis-shaped or missing tensor."""
    layout = model.weight_layout()
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    seen: set[str] = set()
    tied_head = None
    for name, tensor in _checkpoint_tensors(path):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if tied and name == "lm_head.weight":
            tied_head = tensor  # checked against the embedding once that is loaded
            continue
        if name not in layout:
            raise ValueError(
                f"checkpoint {path} has tensor {name!r} that {model.config.architecture} does "
                "not use: is config.json's `architectures` right for these weights?")
        param_name, index = layout[name]
        target = params[param_name].data[index]
        if target.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)} but config.json "
                f"implies {tuple(target.shape)}: the config and the weights disagree")
        target.copy_(tensor)
        seen.add(name)
    if tied_head is not None and not torch.equal(
            tied_head.to(model.lm_head.weight), model.lm_head.weight):
        raise ValueError(
            f"checkpoint {path} has its own lm_head.weight, but config.json ties it to the "
            "embeddings (tie_word_embeddings is true or absent): set tie_word_embeddings "
            "to false in config.json")
    missing = [name for name in layout if name not in seen]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {path} lacks tensor(s) the model needs: {shown}")


def checkpoint_files(path: Path) -> list[Path]:
    """Gives the safetensors files of a model dir: the index's shards, else model*.safetensors,
    else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    # Mistral's repos also carry consolidated.safetensors in another naming scheme.
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model dir {path} has no *.safetensors files")
    return files


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = checkpoint_files(path)
    for file in progress(files, len(files), "loading safetensors shards"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Builds parameters directly in the model dtype, so no full-size float32 copy exists."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
