"""KV-cache sizing the operator can check before a pod exists: a cache too small to serve.

The engine turns `--kv-cache-memory` into whole blocks of `2 x blockSize x kvHeads x headDim
x KV dtype bytes x layers` (1 for an fp8 cache) and starts with at least one, so a cache smaller than one
`maxModelLen` sequence reports ready and answers 400 to every long request. vLLM refuses
to start in that case; the operator refuses the spec, for the models whose shape it knows
(the engine's built-in ones; a `hf://` or `pvc://` model's shape is in its config.json).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.engine.contracts.args import parse_size
from kvpilot.engine.contracts.builtin_models import BUILTIN_CONFIGS
from kvpilot.operator.api.accelerator import Vendor
from kvpilot.operator.api.common import EngineSpec, ModelSource
from kvpilot.operator.planning.quantization import kv_bytes_per_element


@dataclass(frozen=True)
class KvShape:
    """What the size of one KV block depends on, and the model's default length."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int


BUILTIN_SHAPES = {name: KvShape(num_layers=config["num_hidden_layers"],
                                num_kv_heads=config["num_key_value_heads"],
                                head_dim=config["head_dim"],
                                max_model_len=config["max_position_embeddings"])
                  for name, config in BUILTIN_CONFIGS.items()}
"""The KV shape of each of the engine's built-in models (`dummy:` sources)."""


def bytes_per_block(shape: KvShape, block_size: int, dtype_bytes: int) -> int:
    """Gives the bytes of one KV block across all layers (keys and values)."""
    return 2 * block_size * shape.num_kv_heads * shape.head_dim * dtype_bytes * shape.num_layers


def check_kv_cache(model: ModelSource, engine: EngineSpec, vendor: Vendor) -> None:
    """Raises ValueError naming engine.kvCacheMemory when it cannot hold one maxModelLen
    sequence of a model whose shape is known."""
    shape = BUILTIN_SHAPES.get(model.source.removeprefix("dummy:"))
    if engine.kv_cache_memory is None or shape is None:
        return
    tokens = engine.max_model_len or shape.max_model_len
    block = bytes_per_block(shape, engine.block_size, kv_bytes_per_element(engine, vendor))
    need = math.ceil(tokens / engine.block_size) * block
    have = parse_size(engine.kv_cache_memory)
    if have < need:
        raise ValueError(
            f"engine.kvCacheMemory={engine.kv_cache_memory} holds {have // block} KV blocks of "
            f"{block} bytes, but one {tokens}-token sequence (engine.maxModelLen) needs "
            f"{need // block} ({need} bytes): raise kvCacheMemory to at least "
            f"{math.ceil(need / 2**20)}MiB or lower engine.maxModelLen")
