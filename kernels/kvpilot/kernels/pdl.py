"""Programmatic dependent launch (Hopper and later) for the kernels of a decode step.

A decode step at small batch is hundreds of short kernels back to back in a CUDA graph, and
each launch leaves the GPU partly idle: the next grid starts only after the last one has
drained. A kernel launched with PDL (`launch_pdl=True`) may be scheduled while the kernel
before it on the stream finishes; it calls `wait_for_previous` before it reads or writes
anything an earlier kernel touches (`griddepcontrol.wait` returns once the previous grid has
completed and its memory is visible), so only work on data no kernel writes, such as a
weight tile, may come before the wait. The previous grid never triggers its dependents
early: they launch as its programs exit. On one H100, 32 dependent one-row GEMVs at
Llama-3-8B shapes in a graph took 20.9 us each plain and 20.2 with PDL at a TP=2 shard, 39.3
and 38.8 unsharded (bench/kernels/pdl_gemv_gpu.py).

`pdl_args(t)` gives a launch's extra arguments for a kernel taking a `PDL: tl.constexpr`: on
for CUDA tensors on compute capability 9.0+, unless KVPILOT_PDL=0; off (the wait compiled
out) in Triton's interpreter and on older GPUs.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton.language as tl

from kvpilot.kernels.jit import jit

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton without PDL: never launched with it (`_device_has_pdl`)
    gdc_wait = None

ENABLED = os.environ.get("KVPILOT_PDL", "1") != "0"


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return gdc_wait is not None and torch.version.hip is None \
        and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(t: torch.Tensor) -> dict[str, Any]:
    """Gives {"PDL": ..., and launch_pdl=True where on} for a launch on `t`'s device."""
    if ENABLED and t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" \
            and _device_has_pdl(t.device.index if t.device.index is not None
                                else torch.cuda.current_device()):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@jit
def wait_for_previous(PDL: tl.constexpr):
    """Waits until the kernel before this one on the stream has completed (PDL launches)."""
    if PDL:
        gdc_wait()  # pyright: ignore[reportOptionalCall]
