"""Attention backends: the paged-KV layout contract and its implementations."""
