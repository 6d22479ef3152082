"""Tiny HF checkpoints written once per test session, shared by the quantisation tests."""

from __future__ import annotations

import pytest
from helpers.fixtures import tiny_checkpoints  # noqa: F401 (re-exported fixture)


@pytest.fixture(autouse=True)
def _no_grad():
    import torch

    with torch.no_grad():
        yield
