"""The OpenAI-compatible API server in front of the engine core process (`kvpilot serve`)."""
