"""The OpenAI-compatible HTTP server around LLMEngine (`kvpilot serve`)."""
