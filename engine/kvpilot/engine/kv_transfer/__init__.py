"""KV-cache block transfer between a prefill engine and a decode engine."""
