"""Writes random PEFT LoRA adapters for a tiny checkpoint, and the HF + PEFT greedy reference.

    path = write_adapter(base_dir, tmp_path / "sql", ["q_proj", "v_proj"], seed=1)
    tokens = hf_greedy(base_dir, path, prompt, 8)      # path None: the base model alone
"""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def write_adapter(base: Path, out: Path, targets: list[str], *, seed: int, r: int = 8,
                  lora_alpha: int = 16, use_rslora: bool = False) -> Path:
    """Gives the dir `out` holding a PEFT adapter of `base` with random A and B (non-zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=targets,
                        init_lora_weights=False, use_rslora=use_rslora)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # large enough a delta to change the greedy tokens
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(str(out))
    return out


def hf_greedy(base: Path, adapter: Path | None, prompt: list[int], new_tokens: int) -> list[int]:
    """Gives HF transformers' (+ PEFT's, with `adapter`) greedy continuation of `prompt`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                 attn_implementation="eager")
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]
