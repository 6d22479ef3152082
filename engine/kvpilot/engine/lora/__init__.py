"""Multi-LoRA serving: PEFT adapters, their device slots and the batched apply."""
