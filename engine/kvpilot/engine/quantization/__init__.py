"""8-bit weights: int8 weight-only (W8A16) and fp8 W8A8 linear layers, quantised at load time or read from pre-quantised checkpoints."""
