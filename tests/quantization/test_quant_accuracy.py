"""8-bit weights stay close to the unquantised model on the HF-written tiny checkpoints.

Documented bounds (fp32 model, prompt logits of 3 prompts in one flat paged batch):
max |logits - unquantised| / max |unquantised| <= 3% for int8 (W8A16, 7 bits of
mantissa-equivalent per channel) and <= 15% for fp8 (E4M3: 3 mantissa bits on weights
and activations). Greedy agreement (the argmax of every prompt position, teacher-forced)
is printed and bounded: >= 0.95 int8, >= 0.85 fp8. Random tiny models have
near-flat logits, so these are worst-case numbers; fp8 here runs the float32
reference of the `torch._scaled_mm` path (tests/quantization/test_quant_gpu.py runs the
real one on a GPU).
"""

from __future__ import annotations

import pytest
import torch
from helpers.paged import BlockAllocation, step_logits

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.loader import load_model
from kvpilot.engine.models.quantized_linear import QuantLinear

FAMILIES = ["llama", "llama-bias", "qwen3", "mixtral"]
PROMPT_LENS = [9, 23, 40]
# method -> (max relative logit error, least greedy agreement)
BOUNDS = {"int8": (0.03, 0.95), "fp8": (0.15, 0.85)}


def prompt_logits(model) -> torch.Tensor:
    """Gives the logits of every prompt position [sum(PROMPT_LENS), vocab], one flat batch."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=gen)
               for n in PROMPT_LENS]
    alloc = BlockAllocation.shuffled(PROMPT_LENS, 4, seed=7)
    return torch.cat(step_logits(model, prompts, alloc, [PROMPT_LENS]))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_checkpoints):
    """Gives (family, its config, the unquantised model's logits)."""
    path = tiny_checkpoints(request.param)
    config = ModelConfig.from_engine_args(EngineArgs(model=str(path)), torch.device("cpu"))
    with torch.no_grad():
        return request.param, config, prompt_logits(load_model(config, "safetensors", "cpu"))


@pytest.mark.parametrize("method", list(BOUNDS))
def test_logits_close_to_unquantised(family, method):
    name, config, expected = family
    model = load_model(config, "safetensors", "cpu", quantization=method)
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    per_layer = 2 if name == "mixtral" else 4  # the experts stay unquantised
    assert len(quantized) == per_layer * config.num_layers
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    got = prompt_logits(model)
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    agreement = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"{name} {method}: max relative logit error {rel:.4f}, "
          f"greedy agreement {agreement:.3f}")
    max_rel, least_agreement = BOUNDS[method]
    assert 0 < rel <= max_rel
    assert agreement >= least_agreement


@pytest.mark.parametrize("method", list(BOUNDS))
def test_quantised_weights_round_trip(method):
    """Each row's weights come back within half a step of its 8-bit grid (int8) or
    E4M3's relative spacing (fp8); an all-zero row stays zero without dividing by 0."""
    from kvpilot.engine.quantization.methods import METHODS

    weight = torch.randn(32, 64) * torch.logspace(-3, 1, 32)[:, None]
    weight[3] = 0.0
    q, scale = METHODS[method].quantize(weight)
    assert q.dtype == METHODS[method].weight_dtype and scale.shape == (32,)
    back = q.float() * scale[:, None]
    assert torch.equal(back[3], torch.zeros(64))
    if method == "int8":
        assert ((back - weight).abs() <= scale[:, None] / 2 + 1e-9).all()
    else:  # 3 mantissa bits: within 2^-4 relative of the value, or of the smallest normal
        assert ((back - weight).abs() <= weight.abs() / 16 + scale[:, None] * 2**-6).all()
