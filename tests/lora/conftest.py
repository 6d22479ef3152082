"""A tiny Llama checkpoint and PEFT adapters of it, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.checkpoints import write_checkpoint
from helpers.lora_adapters import ATTENTION, MLP, write_adapter

# name -> (targets, rank, alpha, rsLoRA): attention only, MLP only, everything, partial q|v
ADAPTERS = {"attn": (ATTENTION, 8, 16, False), "mlp": (MLP, 4, 8, False),
            "all": (ATTENTION + MLP, 16, 16, True), "qv": (["q_proj", "v_proj"], 8, 32, False)}


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("lora-base"), "llama")


@pytest.fixture(scope="session")
def adapters(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Gives adapter name -> its PEFT dir."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(base_dir, root / name, targets, seed=i + 1, r=r,
                                lora_alpha=alpha, use_rslora=rs)
            for i, (name, (targets, r, alpha, rs)) in enumerate(ADAPTERS.items())}
