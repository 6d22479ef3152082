"""Fixtures of the parallel-engine tests: the tiny HF checkpoints, written once per session."""

from __future__ import annotations

from helpers.fixtures import tiny_checkpoints  # noqa: F401 (re-exported fixture)
