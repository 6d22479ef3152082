"""The engine loop: `LLMEngine`'s step (schedule, run, sample, book), the protocols its
drivers see (`engine_core`), prefill/decode roles, warm-up, step times, and the API side's
per-request state."""
