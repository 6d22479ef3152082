"""Suite-wide markers: GPU tests skip without CUDA, cluster tests without KUBECONFIG."""

from __future__ import annotations

import os

import pytest


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch here")
        for item in gpu_items:
            item.add_marker(skip)
    if not os.environ.get("KUBECONFIG"):
        skip = pytest.mark.skip(reason="needs a real cluster: set KUBECONFIG to run it")
        for item in items:
            if "cluster" in item.keywords:
                item.add_marker(skip)
