"""Prompt logits of every architecture match HF transformers within 1e-4 relative (fp32).

Each case runs several prompts as ONE flat batch through the paged torch backend
with shuffled block tables, in three ways: whole prompts at once; prefill split in
two chunks (the second reads the first chunk's cached KV); and a mixed step where
some sequences decode one token while others prefill their remainder.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.checkpoints import load_hf_model
from helpers.paged import BlockAllocation, step_logits

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.loader import load_model

FAMILIES = ["llama", "llama3", "llama-tied", "llama-bias", "mistral", "qwen2", "qwen3",
            "mixtral"]
PROMPT_LENS = [1, 9, 23, 40]
BLOCK_SIZE = 4
REL_TOL = 1e-4


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Gives max |actual - expected| relative to max |expected|."""
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def prompts(vocab_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (n,), generator=gen) for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tiny_checkpoints):
    """Gives (family, kvpilot model, HF model, HF logits per prompt)."""
    path = tiny_checkpoints(request.param)
    config = ModelConfig.from_engine_args(EngineArgs(model=str(path)), torch.device("cpu"))
    ours = load_model(config, "safetensors", "cpu")
    hf = load_hf_model(path)
    with torch.no_grad():
        expected = [hf(p[None]).logits[0] for p in prompts(config.vocab_size)]
    return request.param, ours, hf, expected


def run_steps(model, steps: list[list[int]]) -> list[torch.Tensor]:
    """Runs the prompts through `steps` (tokens added per sequence per step) and gives
    each prompt's logits for every position, concatenated over steps."""
    alloc = BlockAllocation.shuffled(PROMPT_LENS, BLOCK_SIZE, seed=7)
    got = step_logits(model, prompts(model.config.vocab_size), alloc, steps)
    assert [len(g) for g in got] == PROMPT_LENS
    return got


def two_chunks() -> list[list[int]]:
    first = [(n + 1) // 2 for n in PROMPT_LENS]
    return [first, [n - f for n, f in zip(PROMPT_LENS, first, strict=True)]]


def decode_mix() -> list[list[int]]:
    """Three steps whose middle one mixes query_len-1 rows (decode path) with a chunk."""
    steps = [[0, 8, 10, 20], [1, 1, 12, 1], [0, 0, 1, 19]]
    assert [sum(col) for col in zip(*steps, strict=True)] == PROMPT_LENS
    return steps


@pytest.mark.parametrize(("schedule", "steps"), [
    ("whole prompts", lambda: [PROMPT_LENS]),
    ("two prefill chunks", two_chunks),
    ("decode rows mixed with prefill chunks", decode_mix),
])
def test_prompt_logits_match_hf(pair, schedule, steps):
    family, ours, _, expected = pair
    got = run_steps(ours, steps())
    for n, g, e in zip(PROMPT_LENS, got, expected, strict=True):
        assert g.shape == e.shape, (family, schedule, n)
        err = rel_err(g, e)
        assert err < REL_TOL, f"{family} / {schedule} / prompt of {n}: rel err {err:.2e}"


def test_mixtral_checkpoint_is_sharded(tiny_checkpoints):
    path = tiny_checkpoints("mixtral")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_fp32(tiny_checkpoints, dtype):
    path = tiny_checkpoints("llama")
    cfg32 = ModelConfig.from_engine_args(EngineArgs(model=str(path)), torch.device("cpu"))
    cfg16 = ModelConfig.from_engine_args(
        EngineArgs(model=str(path), dtype=str(dtype).removeprefix("torch.")), torch.device("cpu"))
    assert cfg16.dtype == dtype
    full, half = load_model(cfg32, "auto", "cpu"), load_model(cfg16, "auto", "cpu")
    assert half.lm_head.weight.dtype == dtype
    got, want = run_steps(half, two_chunks()), run_steps(full, two_chunks())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype  # compute_logits gives the model's dtype; consumers widen
        assert rel_err(g, w) < 0.05
