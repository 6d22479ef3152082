"""On CUDA the engine sizes its KV cache by profiling and matches the CPU engine's greedy ids."""

from __future__ import annotations

import pytest
from kvpilot.engine.llm import LLM
from kvpilot.engine.sampling_params import SamplingParams

PROMPTS = [list(range(10, 10 + n)) for n in (5, 40, 17, 90)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.mark.gpu
def test_cuda_engine_matches_cpu_engine(checkpoints):
    path = str(checkpoints["llama"])  # real files: the same weights on both devices
    cpu = LLM(path, device="cpu", num_kv_blocks=64).generate(PROMPTS, GREEDY)
    gpu_llm = LLM(path, device="cuda", dtype="float32", gpu_memory_utilization=0.5,
                  attention_backend="torch")
    gpu = gpu_llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
    stats = gpu_llm.get_stats()
    assert stats.num_total_blocks > 1000  # half an 80 GB card holds far more than 1000 blocks
    assert stats.num_free_blocks == stats.num_total_blocks
