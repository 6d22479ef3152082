"""Shared fixtures of the engine-core tests: tiny HF checkpoints, prompts and HF references."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from core_helpers import FAMILIES, NEW_TOKENS
from helpers.checkpoints import load_hf_model, write_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Gives family -> dir of a tiny random-weight fp32 checkpoint written by transformers."""
    root = tmp_path_factory.mktemp("core-checkpoints")
    return {family: write_checkpoint(root, family, seed=7) for family in FAMILIES}


@pytest.fixture(scope="session")
def parity_prompts() -> list[list[int]]:
    """Gives 16 prompts (token ids) of mixed lengths, six of them sharing a 40-token prefix."""
    rng = random.Random(3)
    shared = [rng.randrange(5, 1000) for _ in range(40)]
    prompts = []
    for i in range(16):
        length = rng.randrange(3, 80)
        tail = [rng.randrange(5, 1000) for _ in range(length)]
        prompts.append(shared + tail[:length // 2] if i % 3 == 0 else tail)
    return prompts


@pytest.fixture(scope="session")
def hf_greedy(checkpoints, parity_prompts) -> dict[str, list[list[int]]]:
    """Gives family -> HF `generate` greedy continuations (NEW_TOKENS each, EOS disabled)."""
    out: dict[str, list[list[int]]] = {}
    for family, path in checkpoints.items():
        model = load_hf_model(path)
        model.generation_config.eos_token_id = None
        continuations = []
        with torch.no_grad():
            for prompt in parity_prompts:
                ids = torch.tensor([prompt])
                seq = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
                continuations.append(seq[0, len(prompt):].tolist())
        out[family] = continuations
    return out
