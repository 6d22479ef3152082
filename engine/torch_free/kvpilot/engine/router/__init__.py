"""The torch-free router: OpenAI endpoints in front of engine pools (`kvpilot route`)."""
