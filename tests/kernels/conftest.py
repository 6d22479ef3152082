"""Runs the Triton kernels on the CPU interpreter unless a CUDA GPU is present.

The interpreter is chosen when ``triton.jit`` decorates a kernel, so the
variable must be set before any ``kvpilot.kernels`` module is imported.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
