"""LoRA on a GPU: the engine with the Triton SGMV kernel and decode CUDA graphs against
HF transformers + PEFT (fp32; where greedy tokens first differ, the engine's token must be in
HF's top 5 at that step: a TF32 near-tie), and a mixed batch of adapters and the base."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.engine_loop.llm_engine import LLMEngine

pytestmark = pytest.mark.gpu
NEW = 8


def _hf_top5_agrees(base_dir, adapter, prompt: list[int], got: list[int]) -> bool:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    ids = list(prompt)
    with torch.no_grad():
        for token in got:
            logits = model(torch.tensor([ids])).logits[0, -1]
            if int(logits.argmax()) != token:
                return token in logits.topk(5).indices.tolist()
            ids.append(token)
    return True


def test_gpu_mixed_batch_matches_hf_peft(base_dir, adapters):
    names = ["attn", "mlp", "all"]
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(base_dir), device="cuda", dtype="float32", enable_lora=True, max_loras=2,
        lora_modules=[f"{n}={adapters[n]}" for n in names], gpu_memory_utilization=0.5))
    rng = random.Random(0)
    requests = {f"{lora}-{i}": ([rng.randrange(5, 1000) for _ in range(6 + 5 * i)], lora)
                for i in range(3) for lora in [*names, None]}
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for rid, (prompt, lora) in requests.items():
        engine.add_request(rid, prompt, greedy, lora_name=lora)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id] += out.completions[0].token_ids
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().graph_steps > 0  # decodes replayed graphs with the LoRA kernel
    for rid, (prompt, lora) in requests.items():
        assert len(tokens[rid]) == NEW
        assert _hf_top5_agrees(base_dir, adapters[lora] if lora else None, prompt, tokens[rid])
