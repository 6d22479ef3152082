"""Host-to-device copies that do not wait for the device's queue, and the `--device` choice.

A copy from pageable host memory to a CUDA device is synchronous: CUDA first
waits until every kernel queued before it has run (the model runner saw it as a
host stall until the forward finished). The copies here go through pinned host
memory instead, so they are only queued, as vLLM's `async_tensor_h2d` does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def limit_host_threads(device: torch.device) -> None:
    """On a GPU, runs torch's CPU ops on one thread unless OMP_NUM_THREADS is set, as vLLM's
    workers do: the engine's own CPU tensors are small, and OpenMP threads spinning after
    each CPU op on every core take the cores the threads working beside the GPU need
    (llguidance's mask fill, one thread per usable CPU)."""
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def resolve_device(name: str) -> torch.device:
    """Gives the torch device for `--device` (auto: CUDA when present)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible: use --device cpu")
    return torch.device(name)


def to_device(values: Sequence[int] | Sequence[float] | Sequence[bool] | np.ndarray,
              device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Gives a small host list (or array) as a tensor on `device` without waiting for the
    device's queue.

    The list goes into a pinned tensor first; the copy is then only queued, and
    PyTorch's caching host allocator keeps the pinned block until it has run.
    """
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    if isinstance(values, np.ndarray):  # torch.tensor(array, pin_memory=True) refuses arrays
        array = torch.from_numpy(np.ascontiguousarray(values))
        host = (array if dtype is None else array.to(dtype)).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


@dataclass
class _Pinned:
    tensor: torch.Tensor  # int64, pinned
    array: np.ndarray  # the same memory as numpy


class StagingBuffer:
    """An int64 host buffer a step fills (through numpy) and copies to the device at once.

    On CUDA it is one persistent pinned buffer, so the copy is asynchronous; the
    previous step's copy must have read it before it is refilled (an event,
    almost always already passed). On CPU each step gets a fresh array: the
    step's tensors alias it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: _Pinned | None = None
        self._copied: torch.cuda.Event | None = None  # of the last upload

    def host(self, size: int) -> tuple[np.ndarray, torch.Tensor]:
        """Gives `size` int64 host elements to fill, as a numpy array and a tensor (one memory)."""
        if self.device.type != "cuda":
            array = np.empty(size, dtype=np.int64)
            return array, torch.from_numpy(array)
        pinned = self._pinned
        if pinned is None or pinned.tensor.numel() < size:
            tensor = torch.empty(max(size, 1 << 16), dtype=torch.int64, pin_memory=True)
            pinned = self._pinned = _Pinned(tensor, tensor.numpy())
        elif self._copied is not None:
            self._copied.synchronize()
        return pinned.array[:size], pinned.tensor[:size]

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """Gives the filled host tensor of `host()` on the device (one non-blocking copy)."""
        if self.device.type != "cuda":
            return host
        out = host.to(self.device, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        return out


class PinnedReadback:
    """Copies small device tensors (a step's sampled ids) to the host without a host wait.

    Two pinned buffers take turns: the host reads one step's copy while the
    next step's copy lands in the other.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._buffers: list[torch.Tensor] = []  # made on first use: only CUDA engines pin
        self._count = 0

    def start(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Gives (the host tensor `values` lands in, the event after which it is there)."""
        if not self._buffers:
            self._buffers = [torch.empty(self.size, dtype=values.dtype, pin_memory=True)
                             for _ in range(2)]
        self._count += 1
        host = self._buffers[self._count % 2][:values.shape[0]]
        host.copy_(values, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready
