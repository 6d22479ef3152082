"""The batch's token bitmask: a reused host buffer, its device copy, and applying it to logits
(on CUDA by `kvpilot.kernels.token_bitmask`).

The grammar library writes one int32 row per sampled sequence (bit k of word w
allows token 32 * w + k) into a host buffer allocated once (pinned on CUDA, so
the copy to the device does not wait for the forward in flight). The buffer is
written again only after the previous copy out of it finished (a CUDA event),
so steps never see each other's rows.
"""

from __future__ import annotations

import sys

import torch

# the byte view of an int32 word is least-significant byte first on every torch device we run
assert sys.byteorder == "little", "apply_token_bitmask reads int32 words as little-endian bytes"


class BitmaskBuffer:
    """A host int32 [rows, words] mask reused step after step, and its copy to the device."""

    def __init__(self, words: int, device: torch.device) -> None:
        self.words = words
        self.device = device
        self._host = torch.empty(0, words, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None  # the last copy out of `_host`

    def rows(self, n: int) -> torch.Tensor:
        """Gives the host mask's first `n` rows with every bit set (every token allowed), safe
        to write: the previous step's copy out of the buffer has finished."""
        if self._copied is not None:
            self._copied.synchronize()  # done long ago in practice: its step was read back
            self._copied = None
        if self._host.shape[0] < n:
            pin = self.device.type == "cuda"
            self._host = torch.empty(max(n, 2 * self._host.shape[0]), self.words,
                                     dtype=torch.int32, pin_memory=pin)
        rows = self._host[:n]
        rows.fill_(-1)
        return rows

    def to_device(self, rows: torch.Tensor) -> torch.Tensor:
        """Gives `rows` (from `rows()`) on the device: an asynchronous copy on CUDA, the host
        tensor itself on CPU."""
        if self.device.type != "cuda":
            return rows
        out = rows.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out


_BIT_OF_BYTE: dict[torch.device, torch.Tensor] = {}  # device -> uint8 [8]: 1 << j


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Gives `logits` [N, vocab] with every token whose bit is 0 in `bitmask` [N, words] (int32,
    on the logits' device) set to -inf: one Triton pass on CUDA; elsewhere one bool
    [N, 32 * words] temporary and one select."""
    if logits.is_cuda:
        from kvpilot.kernels.token_bitmask import apply_token_bitmask as kernel

        return kernel(logits, bitmask)
    n, vocab = logits.shape
    dev = logits.device
    bits = _BIT_OF_BYTE.get(dev)
    if bits is None:
        bits = _BIT_OF_BYTE[dev] = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8,
                                                device=dev)
    words = bitmask.shape[1]
    allowed = (bitmask.contiguous().view(torch.uint8).view(n, 4 * words, 1) & bits) != 0
    return torch.where(allowed.view(n, 32 * words)[:, :vocab], logits, float("-inf"))
