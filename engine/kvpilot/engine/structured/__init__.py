"""Structured outputs: grammars from llguidance, matched per request, masked in the sampler."""
