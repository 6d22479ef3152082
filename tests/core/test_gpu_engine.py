"""On CUDA the engine sizes its KV cache by profiling and matches the CPU engine's greedy ids."""

from __future__ import annotations

import pytest

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.entrypoints.llm import LLM

PROMPTS = [list(range(10, 10 + n)) for n in (5, 40, 17, 90)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def cpu_greedy(checkpoints) -> list[list[int]]:
    llm = LLM(str(checkpoints["llama"]), device="cpu", num_kv_blocks=64)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_engine_matches_cpu_engine(backend, checkpoints, cpu_greedy):
    # real files, not dummy weights: the same weights on both devices
    gpu_llm = LLM(str(checkpoints["llama"]), device="cuda", dtype="float32",
                  gpu_memory_utilization=0.5, attention_backend=backend,
                  max_num_batched_tokens=64)  # chunked prefill mixes with decodes
    gpu = gpu_llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in gpu] == cpu_greedy
    stats = gpu_llm.get_stats()
    assert stats.num_total_blocks > 1000  # half a GPU holds far more than 1000 blocks
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.gpu
def test_cuda_auto_backend_runs_bf16():
    llm = LLM("tiny-llama", device="cuda", gpu_memory_utilization=0.5)
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert type(llm.engine.runner.model.attn_backend).__name__ == "TritonAttentionBackend"
