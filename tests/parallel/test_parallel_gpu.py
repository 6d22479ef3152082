"""Tensor and pipeline parallelism on GPUs (NCCL): TP=2 and PP=2 on 2 GPUs, TP=4 and
TP=2 x PP=2 on 4 GPUs match TP=1 in bf16 under a top-5 rule (every greedy token of the
parallel run is within TP=1's top 5 at that step, TP=1 teacher-forced on the parallel run's
prefix); TP=4 with EP=1 and EP=4 on a Mixtral-shaped model gives TP=1's very tokens in
float32. Single-stage runs replay CUDA graphs with their all-reduces inside; pipeline stages
run eagerly and keep two batches in flight."""

from __future__ import annotations

import gc
import json
import random
from pathlib import Path

import pytest
import torch

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.entrypoints.llm import LLM

pytestmark = pytest.mark.gpu
NEW_TOKENS = 32
LLAMA_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}
MIXTRAL_SHAPE = {**LLAMA_SHAPE, "architectures": ["MixtralForCausalLM"],
                 "intermediate_size": 1024, "num_hidden_layers": 4, "num_local_experts": 8,
                 "num_experts_per_tok": 2}
ENGINE = dict(load_format="dummy", dtype="bfloat16", kv_cache_memory="1GiB",
              max_model_len=1024, max_num_seqs=16)


def need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs; {torch.cuda.device_count()} visible")


def model_dir(root: Path, config: dict) -> Path:
    """Gives a dir with config.json and a word-level tokenizer covering the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(config["vocab_size"])},
                                     unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tokenizer.json"))
    return root


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(8, 200))] for _ in range(8)]


def tp_greedy(path: Path, tp: int, ep: int, batch: list[list[int]],
              pp: int = 1, dtype: str = "bfloat16") -> list[list[int]]:
    """Gives the parallel run's greedy tokens; checks its decode steps replayed CUDA graphs
    (one stage) or that two batches were in the pipeline at once (two stages)."""
    llm = LLM(str(path), tensor_parallel_size=tp, expert_parallel_size=ep,
              pipeline_parallel_size=pp, **{**ENGINE, "dtype": dtype})
    try:
        outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                     ignore_eos=True))
        if pp == 1:
            assert llm.get_stats().graph_steps > 0  # decode graphs hold the all-reduces
        else:
            assert llm.engine.runner.max_in_flight == pp  # type: ignore[attr-defined]
    finally:
        llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outputs]


def assert_top5(path: Path, batch: list[list[int]], got: list[list[int]]) -> None:
    """TP=1, teacher-forced on prompt + the TP tokens, ranks each TP token in its top 5."""
    reference = LLM(str(path), **ENGINE)
    for prompt, tokens in zip(batch, got, strict=True):
        scored = reference.generate([prompt + tokens], SamplingParams(max_tokens=1,
                                                                      prompt_logprobs=5))[0]
        assert scored.prompt_logprobs is not None
        for j, token in enumerate(tokens):
            ranked = scored.prompt_logprobs[len(prompt) + j]
            assert ranked is not None and ranked[token].rank <= 5, (j, token, ranked)


def test_tp2_matches_tp1(tmp_path: Path):
    need_gpus(2)
    path = model_dir(tmp_path / "llama", LLAMA_SHAPE)
    batch = prompts(LLAMA_SHAPE["vocab_size"])
    assert_top5(path, batch, tp_greedy(path, 2, 1, batch))


def test_tp4_matches_tp1(tmp_path: Path):
    need_gpus(4)
    path = model_dir(tmp_path / "model", LLAMA_SHAPE)
    batch = prompts(LLAMA_SHAPE["vocab_size"])
    assert_top5(path, batch, tp_greedy(path, 4, 1, batch))


@pytest.mark.parametrize("ep", [1, 4], ids=["mixtral-tp4-ep1", "mixtral-tp4-ep4"])
def test_tp4_moe_matches_tp1_in_float32(tmp_path: Path, ep: int):
    """In float32 the Mixtral-shaped model's TP=4 tokens equal TP=1's. Not in bf16 under the
    top-5 rule: with dummy weights the router's scores nearly tie, so a bf16 rounding
    difference picks another expert and the sequences part (measured on 4 H100s: fp32 32/32
    tokens equal on every sequence at EP=1 and EP=4; bf16 parted after 2-23 tokens)."""
    need_gpus(4)
    path = model_dir(tmp_path / "model", MIXTRAL_SHAPE)
    batch = prompts(MIXTRAL_SHAPE["vocab_size"])[:4]
    want = tp_greedy(path, 1, 1, batch, dtype="float32")
    assert tp_greedy(path, 4, ep, batch, dtype="float32") == want


def test_pp2_matches_tp1(tmp_path: Path):
    need_gpus(2)
    path = model_dir(tmp_path / "llama", LLAMA_SHAPE)
    batch = prompts(LLAMA_SHAPE["vocab_size"])
    assert_top5(path, batch, tp_greedy(path, 1, 1, batch, pp=2))


def test_tp2_pp2_matches_tp1(tmp_path: Path):
    need_gpus(4)
    path = model_dir(tmp_path / "llama", LLAMA_SHAPE)
    batch = prompts(LLAMA_SHAPE["vocab_size"])
    assert_top5(path, batch, tp_greedy(path, 2, 1, batch, pp=2))
