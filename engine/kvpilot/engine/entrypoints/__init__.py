"""Entry points that run the engine in the caller's process: the offline `LLM` (its vLLM
keywords and chat helpers), `kvpilot generate`, and the event loop the API servers and load
generators run on."""
