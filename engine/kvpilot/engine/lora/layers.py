"""LoRA on the device: adapter slots stacked per projection, added to the base layers'
outputs by forward hooks, for every token of a mixed batch at once.

Our model merges q|k|v and gate|up into one linear each, so a seam stacks its parts'
adapters along the rank: A [S, P*R, in] holds part p's A in rows p*R.., and B [S, out, P*R]
holds part p's B (times the adapter's scale) in part p's output rows and rank columns,
zeros elsewhere: one shrink and one expand give each part only its own delta, and a part
an adapter does not target stays zero. S = --max-loras slots, R = --max-lora-rank.

`LoRAMapping` says which slot each token of the step uses (-1: the base model). It lives in
a persistent buffer the runner fills before the forward, so a CUDA graph captured with the
hooks replays with each step's mapping: on CUDA a pre-hook on the model groups the tokens by
slot on the device once per forward, into a fixed-size table of blocks of at most 16 tokens
of one slot (base tokens get none), and, for a decode-sized batch, whose shrink splits K
and adds with atomics, zeroes one float32 workspace for every seam's rank-space product;
every projection's hook then launches the Triton kernels (`kvpilot.kernels.lora_sgmv`) over
that table, a program per row and column block: cdiv(T, 16) + S rows, not token blocks x
S slots, and a program on an unused row exits at once (the kernel module gives the H100
numbers behind it). Elsewhere the hooks run the torch reference over the slots present.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from kvpilot.engine.lora.peft_adapter import PeftAdapter
from kvpilot.engine.models.layers import MergedLinear

if TYPE_CHECKING:
    from kvpilot.kernels.lora_sgmv import SlotGroups

# (module of the decoder layer, its linear, the PEFT projections it stacks)
SEAMS = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
         ("self_attn", "o_proj", ("o_proj",)),
         ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
         ("mlp", "down_proj", ("down_proj",)))


class LoRAMapping:
    """Each token's adapter slot for the step in flight (-1: base), on the device."""

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.use_kernel = device.type == "cuda"
        # the kernel path's tokens grouped by slot and its block table, made once per
        # forward (`group`)
        self.grouped: SlotGroups | None = None
        # [seams, tokens, widest seam's rank] float32 zeros for a decode-sized forward's
        # shrinks (`group`), else None and each shrink makes its own
        self.workspace: torch.Tensor | None = None
        self.seams = 0  # how many seams share the workspace
        self.width = 0  # the widest seam's stacked rank
        # the torch path's (slot, token rows) of the step, read on the host
        self.groups: list[tuple[int, torch.Tensor]] = []

    def set(self, slots: np.ndarray) -> None:
        """Sets the step's per-token slots (tokens beyond them get -1)."""
        count = len(slots)
        if count > self.token_slots.shape[0]:
            raise ValueError(f"{count} tokens exceed the LoRA mapping's "
                             f"{self.token_slots.shape[0]} (max_num_batched_tokens)")
        self.token_slots.fill_(-1)
        host = torch.from_numpy(slots.astype(np.int32))
        self.token_slots[:count].copy_(host, non_blocking=True)
        if self.use_kernel:
            return
        self.groups = [(int(slot), torch.from_numpy(np.flatnonzero(slots == slot)))
                       for slot in np.unique(slots) if slot >= 0]

    def group(self, num_tokens: int, num_slots: int) -> None:
        """Groups the forward's `num_tokens` tokens by slot on the device and makes their
        block table, for every layer (inside a CUDA graph when one is captured)."""
        if self.use_kernel:
            from kvpilot.kernels.lora_sgmv import group_by_slot, shrink_splits

            self.grouped = group_by_slot(self.token_slots[:num_tokens], num_slots)
            self.workspace = None
            if shrink_splits(num_tokens):
                self.workspace = torch.zeros(self.seams, num_tokens, self.width,
                                             dtype=torch.float32, device=self.token_slots.device)


@dataclass
class _Seam:
    """One linear of one layer: its parts' output rows and its slots' stacked A and B."""

    layer: int
    projections: tuple[str, ...]
    part_rows: list[slice]
    a: torch.Tensor  # [S, P*R, in]
    b: torch.Tensor  # [S, out, P*R]
    index: int  # its rows in the mapping's workspace

    def __post_init__(self) -> None:
        # each part's output rows, for the kernel's part-aware expand (made once, not per call)
        self.parts = tuple(rows.stop - rows.start for rows in self.part_rows)

    def delta_into(self, out: torch.Tensor, x: torch.Tensor, mapping: LoRAMapping) -> None:
        if mapping.grouped is not None:
            from kvpilot.kernels.lora_sgmv import lora_sgmv_

            workspace = mapping.workspace
            tmp = None if workspace is None else workspace[self.index, :, :self.a.shape[1]]
            lora_sgmv_(out, x, self.a, self.b, mapping.grouped, tmp=tmp,
                       parts=self.parts)
            return
        for slot, rows in mapping.groups:
            out.index_add_(0, rows, (x[rows] @ self.a[slot].T) @ self.b[slot].T)


class LoRAModel:
    """The slots of every seam of a model and the hooks that apply them."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_tokens: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.mapping = LoRAMapping(max_tokens, device)
        self.resident: list[str | None] = [None] * max_loras  # adapter name per slot
        self.seams: dict[tuple[int, str], _Seam] = {}  # (layer, PEFT projection) -> seam
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"enable_lora: {type(model).__name__} has no decoder layers to "
                             "adapt: drop --enable-lora")
        for index, layer in enumerate(layers):
            for owner, attr, projections in SEAMS:
                linear = getattr(getattr(layer, owner), attr, None)
                if not isinstance(linear, nn.Linear):  # an MoE block has no dense MLP
                    continue
                self._add_seam(index, linear, projections, max_loras, max_rank, device, dtype)
        # args[0]: the step's input ids (piecewise graphs call group_tokens themselves)
        model.register_forward_pre_hook(lambda _module, args: self.group_tokens(args[0].shape[0]))

    def group_tokens(self, num_tokens: int) -> None:
        """Groups a forward's tokens by adapter slot, first thing in the forward."""
        self.mapping.group(num_tokens, self.max_loras)

    def _add_seam(self, layer: int, linear: nn.Linear, projections: tuple[str, ...],
                  slots: int, rank: int, device: torch.device, dtype: torch.dtype) -> None:
        if isinstance(linear, MergedLinear):
            part_rows = [linear.shard_rows(i) for i in range(len(projections))]
        else:
            part_rows = [slice(0, linear.out_features)]
        width = rank * len(projections)
        mapping = self.mapping
        seam = _Seam(layer, projections, part_rows,
                     torch.zeros(slots, width, linear.in_features, dtype=dtype, device=device),
                     torch.zeros(slots, linear.out_features, width, dtype=dtype, device=device),
                     mapping.seams)
        mapping.seams += 1
        mapping.width = max(mapping.width, width)
        for proj in projections:
            self.seams[(layer, proj)] = seam

        def add_lora(_module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            seam.delta_into(out, args[0], mapping)
            return out

        linear.register_forward_hook(add_lora)

    def check(self, adapter: PeftAdapter) -> None:
        """Raises ValueError naming the adapter and the fix when it does not fit this model."""
        for key, (a, b) in adapter.weights.items():
            seam = self.seams.get(key)
            if seam is None:
                raise ValueError(f"LoRA adapter {adapter.name!r} adapts layer {key[0]} {key[1]}, "
                                 "which this model has not as a dense projection: use an "
                                 "adapter trained for this base model")
            part = seam.projections.index(key[1])
            rows = seam.part_rows[part]
            want_a = (adapter.rank, seam.a.shape[2])
            want_b = (rows.stop - rows.start, adapter.rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ValueError(f"LoRA adapter {adapter.name!r}: layer {key[0]} {key[1]} has "
                                 f"A {tuple(a.shape)} and B {tuple(b.shape)}, this model needs "
                                 f"{want_a} and {want_b}: use an adapter of this base model")

    def load(self, slot: int, adapter: PeftAdapter) -> None:
        """Copies `adapter` (checked) into `slot`, zeros where it targets nothing."""
        for seam in {id(s): s for s in self.seams.values()}.values():
            seam.a[slot].zero_()
            seam.b[slot].zero_()
        for (layer, proj), (a, b) in adapter.weights.items():
            seam = self.seams[(layer, proj)]
            part = seam.projections.index(proj)
            cols = slice(part * self.max_rank, part * self.max_rank + adapter.rank)
            seam.a[slot, cols].copy_(a)
            seam.b[slot, seam.part_rows[part], cols].copy_(b * adapter.scale)
        self.resident[slot] = adapter.name
