"""The operator's torch-free copies of the engine's built-in models match the engine's."""

from __future__ import annotations

from kvpilot.engine.models.builtin import BUILTIN_CONFIGS
from kvpilot.operator.api.common import BUILTIN_MODELS
from kvpilot.operator.planning.kv_cache import BUILTIN_SHAPES, KvShape


def test_dummy_sources_are_the_engine_builtins():
    assert set(BUILTIN_MODELS) == set(BUILTIN_CONFIGS) == set(BUILTIN_SHAPES)


def test_kv_shapes_are_the_engine_configs():
    for name, config in BUILTIN_CONFIGS.items():
        assert BUILTIN_SHAPES[name] == KvShape(
            num_layers=config["num_hidden_layers"], num_kv_heads=config["num_key_value_heads"],
            head_dim=config["head_dim"], max_model_len=config["max_position_embeddings"])
