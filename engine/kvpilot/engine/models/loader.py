"""Builds a model for its config (or one tensor-parallel rank's shard of one pipeline stage
of it) and fills its weights from safetensors or at random, reading only the slices this
rank holds."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.fused import use_fused_kernels
from kvpilot.engine.models.layers import WeightLayout, WeightSlot
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.models.quantized_linear import quantize_linears, scale_layout
from kvpilot.engine.models.registry import model_class
from kvpilot.engine.parallel.groups import SINGLE_RANK, TPGroup
from kvpilot.engine.parallel.stage import PipelineStage
from kvpilot.engine.quantization.config import resolve_quantization

logger = logging.getLogger(__name__)
Item = TypeVar("Item")
DUMMY_STD = 0.02
# Checkpoint tensors that carry no weights the model needs.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Scales some quantised checkpoints carry that kvpilot does not read.
_UNREAD_SCALES = ("input_scale", "k_scale", "v_scale", "kv_scale")


def load_model(config: ModelConfig, load_format: str, device: torch.device | str,
               seed: int = 0, fused_kernels: bool | None = None,
               tp: TPGroup = SINGLE_RANK, stage: PipelineStage | None = None,
               quantization: str = "none") -> LlamaForCausalLM:
    """Gives the model for `config` (tensor-parallel rank `tp`'s shard of pipeline stage
    `stage`, default the whole model) on `device`,
    in eval mode, weights loaded per `load_format` (auto, safetensors or dummy), its
    projection layers in 8 bits per `quantization` or the checkpoint's own, with the
    Triton kernels of `kvpilot.kernels` in its norm/activation/rotary seams when
    `fused_kernels` (default: on CUDA)."""
    fmt = resolve_load_format(config, load_format)
    quant = resolve_quantization(quantization, config.hf_config, config.architecture)
    device = torch.device(device)
    with _default_dtype(config.dtype), device:
        model = model_class(config.architecture)(config, tp=tp, stage=stage)
    checkpoint = None if fmt == "dummy" else config.model_path  # set for safetensors
    prequantized = quant is not None and quant.prequantized and checkpoint is not None
    if checkpoint is None:
        init_dummy_weights(model, seed)
    elif quant is not None and prequantized:
        layout = model.weight_layout()  # before the swap: the layouts read the layer types
        layout |= scale_layout(layout, quantize_linears(model, quant.method, quantize=False))
        load_safetensors(model, Path(checkpoint), progress_bar=tp.is_first, layout=layout)
    else:
        load_safetensors(model, Path(checkpoint), progress_bar=tp.is_first)
    if quant is not None and not prequantized:
        quantize_linears(model, quant.method)
    swapped: list[str] = []
    if fused_kernels:
        swapped = use_fused_kernels(model)
    elif fused_kernels is None and device.type == "cuda":
        try:
            swapped = use_fused_kernels(model)
        except ImportError as exc:  # e.g. a CUDA build without Triton: torch ops still work
            logger.warning("fused kernels unavailable (%s); the model runs torch ops", exc)
    if swapped and tp.is_first:
        logger.info("fused kernels: %s", ", ".join(swapped))
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


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Fills every weight as if from a checkpoint of N(0, 0.02) tensors: each checkpoint
    tensor is drawn whole from a generator seeded by `seed` and its name, on the weights'
    device, then this rank's slice is copied in, so every tensor-parallel size holds the
    same full model. Norm weights get ones, as in a freshly initialised HF model."""
    params = dict(model.named_parameters())
    for name, slot in model.weight_layout().items():
        if slot.param is None:
            continue
        target = params[slot.param].data[slot.index]
        if name.endswith("norm.weight"):
            target.fill_(1.0)
            continue
        generator = torch.Generator(device=target.device).manual_seed(_tensor_seed(seed, name))
        full = torch.empty(slot.shape, dtype=target.dtype, device=target.device)
        target.copy_(full.normal_(0.0, DUMMY_STD, generator=generator)[slot.source])


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def load_safetensors(model: LlamaForCausalLM, path: Path, progress_bar: bool = True,
                     layout: WeightLayout | None = None) -> None:
    """Copies this rank's slice of every checkpoint tensor into its place (reading only that
    slice); raises naming any unexpected, mis-shaped or missing tensor. `progress_bar`: one
    over the shards on an interactive terminal (the driver's; the workers' would overlap it).
    `layout`: where tensors land (default: the model's own)."""
    layout = layout if layout is not None else model.weight_layout()
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    seen: set[str] = set()
    tied_head = None
    files = checkpoint_files(path)
    shards = progress(files, len(files), "loading safetensors shards") if progress_bar else files
    for file in shards:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith(_IGNORED_SUFFIXES) or model.other_stage(name):
                    continue
                if tied and name == "lm_head.weight":
                    # checked against the embedding's slice once that is loaded
                    tied_head = _read(f, name, layout["model.embed_tokens.weight"])
                    continue
                if name not in layout and name.endswith(_UNREAD_SCALES):
                    raise ValueError(
                        f"checkpoint {path} has tensor {name!r}: static activation or KV-cache "
                        "scales are not read (activations are scaled per token, the fp8 KV "
                        "cache uses scale 1.0): serve the bf16 checkpoint with --quantization")
                if name not in layout:
                    raise ValueError(
                        f"checkpoint {path} has tensor {name!r} that {model.config.architecture}"
                        " does not use: is config.json's `architectures` right for these weights?")
                slot = layout[name]
                seen.add(name)
                if slot.per_row:
                    params[str(slot.param)].data[slot.index].copy_(
                        _read_scale(f.get_tensor(name), name, slot))
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != slot.shape:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {shape} but config.json implies "
                        f"{slot.shape}: the config and the weights disagree")
                if slot.param is not None:
                    params[slot.param].data[slot.index].copy_(_read(f, name, slot))
    if tied_head is not None and model.lm_head is not None:
        embed = layout["model.embed_tokens.weight"]
        if not torch.equal(tied_head.to(model.lm_head.weight),
                           model.lm_head.weight.data[embed.index]):
            raise ValueError(
                f"checkpoint {path} has its own lm_head.weight, but config.json ties it to the "
                "embeddings (tie_word_embeddings is true or absent): set tie_word_embeddings "
                "to false in config.json")
    missing = [name for name in layout if name not in seen]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {path} lacks tensor(s) the model needs: {shown}")


def _read(f: Any, name: str, slot: WeightSlot) -> torch.Tensor:
    """Gives the slot's slice of checkpoint tensor `name`, read from disk alone."""
    return f.get_slice(name)[slot.source] if slot.source else f.get_tensor(name)


def _read_scale(scale: torch.Tensor, name: str, slot: WeightSlot) -> torch.Tensor:
    """Gives the slot's rows of a per-tensor ([] or [1]) or per-row scale, as float32."""
    rows = slot.shape[0]
    flat = scale.float().reshape(-1)
    if flat.numel() == 1:
        flat = flat.expand(rows)
    elif flat.numel() != rows:
        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(scale.shape)}: a "
                         f"per-tensor or per-channel scale of {rows} rows must have 1 or "
                         f"{rows} values (block-wise scales are not supported)")
    return flat[slot.source] if slot.source else flat


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


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Builds parameters directly in the model dtype, so no full-size float32 copy exists."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def progress(items: Iterable[Item], total: int, desc: str) -> Iterator[Item]:
    """Gives `items`, with a progress bar on stderr when it is an interactive terminal (a pod's
    log is not: the start-up log says enough, `worker/startup_log.py`)."""
    if total <= 1 or not sys.stderr.isatty():
        yield from items
        return
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, unit="file", file=sys.stderr, leave=False)
