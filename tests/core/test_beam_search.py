"""Beam search (width 4, fixed length, no EOS) equals HF's best beam; beams share blocks."""

from __future__ import annotations

import torch
from core_helpers import run_engine
from helpers.checkpoints import load_hf_model

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine
from kvpilot.engine.entrypoints.llm import LLM

PROMPTS = [list(range(300, 350)), [17, 400, 23, 9, 71], list(range(500, 521))]
NEW_TOKENS = 8
WIDTH = 4


def hf_beam(path, prompt: list[int]) -> list[int]:
    model = load_hf_model(path)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=WIDTH,
                             do_sample=False, length_penalty=0.0, early_stopping=True,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_best_beam_equals_hf(checkpoints):
    llm = LLM(str(checkpoints["llama"]), num_kv_blocks=64)
    params = SamplingParams(beam_width=WIDTH, max_tokens=NEW_TOKENS, ignore_eos=True,
                            length_penalty=0.0)
    outputs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert len(out.outputs) == WIDTH
        scores = [c.cumulative_logprob for c in out.outputs]
        assert scores == sorted(scores, reverse=True)
        assert out.outputs[0].token_ids == hf_beam(checkpoints["llama"], prompt)
    assert llm.get_stats().num_free_blocks == 64


def test_beams_share_the_prompt_blocks():
    engine = LLMEngine.from_engine_args(EngineArgs(model="tiny-llama", num_kv_blocks=32))
    prompt = list(range(100, 150))  # 3 full blocks + 2 tokens
    engine.add_request("b", prompt, SamplingParams(beam_width=WIDTH, max_tokens=6,
                                                   ignore_eos=True))
    request = engine.requests["b"]
    for _ in range(4):
        engine.step()
        tables = [engine.kv.block_ids(seq) for seq in request.seqs]
        stats = engine.get_stats()
        used = stats.num_total_blocks - stats.num_free_blocks
        assert all(t[:3] == tables[0][:3] for t in tables)  # one copy of the full prompt blocks
        assert used == len({b for t in tables for b in t})  # every used block belongs to a beam
    assert len(tables) == WIDTH
    # beams own at most their partial block (copy-on-write): 3 shared + 4, not 4 x 4
    assert used <= 3 + WIDTH
    run_engine(engine)
    assert engine.get_stats().num_free_blocks == 32
