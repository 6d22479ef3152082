"""The engine serves 8-bit weights end to end on CPU: int8 generates, its weights take
fewer bytes, fp8 is refused naming the flag and the device, and tensor parallelism
(gloo, 2 ranks) slices quantised weights and their scales."""

from __future__ import annotations

import pytest
from helpers.quantized_checkpoints import write_quantized

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.entrypoints.llm import LLM

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 110)), [7] * 21]


def generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_int8_generates_with_fewer_weight_bytes(tiny_checkpoints):
    path = str(tiny_checkpoints("llama"))
    full = LLM(path, num_kv_blocks=32)
    int8 = LLM(path, num_kv_blocks=32, quantization="int8")
    want, got = generate(full), generate(int8)
    agreement = sum(a == b for g, w in zip(got, want, strict=True)
                    for a, b in zip(g, w, strict=True)) / sum(len(w) for w in want)
    print(f"int8 greedy token agreement with fp32: {agreement:.3f}")
    assert agreement >= 0.9
    # the projections shrink 4x (fp32 -> int8); the tied-free head and embeddings do not
    full_bytes = full.engine.runner.load_report().weight_bytes
    assert int8.engine.runner.load_report().weight_bytes < 0.8 * full_bytes


def test_fp8_refused_on_cpu():
    with pytest.raises(ValueError, match=r"quantization='fp8' needs a GPU .* not cpu"):
        LLM("tiny-llama", quantization="fp8")


def test_unknown_quantization_names_the_choices():
    with pytest.raises(ValueError, match="quantization='int4' is invalid: choose one of none"):
        EngineArgs(model="tiny-llama", quantization="int4")


# name -> (family, make the model dir: None = quantise at load with int8)
TP_CASES = ["load-time-int8", "prequantised-int8-channel"]


@pytest.mark.parametrize("case", TP_CASES)
def test_tp2_quantised_matches_one_rank(case, tiny_checkpoints, tmp_path):
    """A pre-quantised checkpoint gives TP=2 the same tokens as one rank (the same weights
    and scales, sliced). Quantised at load, a row-parallel layer's ranks each scale
    their own columns, so TP=2 differs from one rank by rounding: tokens mostly agree."""
    src = tiny_checkpoints("llama-bias")
    if case == "load-time-int8":
        model, flags = str(src), {"quantization": "int8"}
    else:
        model = str(write_quantized(src, tmp_path / "q", "int8", "channel",
                                    "compressed-tensors"))
        flags = {}
    want = generate(LLM(model, num_kv_blocks=32, **flags))
    llm = LLM(model, num_kv_blocks=32, tensor_parallel_size=2, **flags)
    try:
        got = generate(llm)
    finally:
        llm.engine.shutdown()
    if case == "prequantised-int8-channel":
        assert got == want
    else:
        same = sum(a == b for g, w in zip(got, want, strict=True)
                   for a, b in zip(g, w, strict=True))
        assert same >= 0.8 * sum(len(w) for w in want)
