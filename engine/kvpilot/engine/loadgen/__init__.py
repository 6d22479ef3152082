"""`kvpilot bench serve`: a torch-free load generator for OpenAI-compatible servers."""
