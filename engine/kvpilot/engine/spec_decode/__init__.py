"""Speculative decoding: draft proposers, the rejection sampler and the engine's spec step."""
