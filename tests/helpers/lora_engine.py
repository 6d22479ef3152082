"""Fakes an engine that takes the LoRA flags (the lora-engine contract: `--enable-lora
--lora-modules name=path ... --max-loras N --max-lora-rank R`) for operator tests in a
checkout whose engine has none yet."""

from __future__ import annotations

import pytest

import kvpilot.operator.render.adapters as adapters_render
import kvpilot.operator.render.engine_args as engine_args_render


def fake_lora_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the operator render spec.adapters as if its engine took the LoRA flags."""
    if adapters_render.engine_serves_lora():
        return  # the real flags and the engine's own checks apply
    monkeypatch.setattr(adapters_render, "engine_serves_lora", lambda: True)
    monkeypatch.setattr(engine_args_render, "check_lora_line", lambda line: None)
