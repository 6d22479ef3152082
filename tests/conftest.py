"""Suite-wide set-up: Triton's CPU interpreter without CUDA; GPU tests skip without
CUDA, cluster tests without KUBECONFIG."""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import HealthCheck, settings

# No per-example deadline and no too-slow health check: a loaded 2-core CI box runs an
# example past Hypothesis's default 200 ms (a KV control-frame round trip did).
settings.register_profile("suite", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("suite")


@functools.cache
def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# Triton picks the interpreter when `@triton.jit` decorates a kernel, so this must
# happen before any test module imports kvpilot.kernels, whichever folder it is in.
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One torch thread in this process and every process a test starts: tiny CPU models gain
    # nothing from a second thread, and on a loaded 2-core box OpenMP threads spin waiting
    # for each other's preempted core (one small SDPA call: 90 ms with 2 threads, 0.6 ms
    # with 1, measured here).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


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
