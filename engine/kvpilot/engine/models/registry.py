"""Which model class runs which HF architecture name."""

from __future__ import annotations

from kvpilot.engine.models.config import SUPPORTED_ARCHITECTURES
from kvpilot.engine.models.llama import LlamaForCausalLM
from kvpilot.engine.models.mixtral import MixtralForCausalLM

# every class is the Llama decoder or a variant of it (Mixtral swaps in a sparse MoE)
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """Gives the model class for an HF architecture name."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(
            f"architectures=[{architecture!r}] in config.json is not supported: kvpilot runs "
            f"{', '.join(MODEL_CLASSES)}")
    return MODEL_CLASSES[architecture]
