"""Swaps a model's projection layers (q|k|v, o, gate|up, down) for 8-bit ones.

The LM head, the embeddings, norms, the MoE router and the MoE experts stay in the
model dtype: the head and embeddings hold little of a model's bytes per decoded token
next to the layers and are the most sensitive to rounding. Tensor-parallel slices
carry over: a column-parallel layer's scales are its own rows', a row-parallel
layer keeps every output row (so all of its scales) and all-reduces where the layer it
replaces did (`RowParallelLinear.reduce_output`; else the norm after it sums).
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.models.layers import WeightLayout, WeightSlot
from kvpilot.engine.models.parallel_layers import RowParallelLinear
from kvpilot.engine.parallel.groups import TPGroup
from kvpilot.engine.quantization.methods import QuantMethod

QUANTIZED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class QuantLinear(nn.Module):
    """A linear layer over an 8-bit `weight` [out, in] with float32 `weight_scale` [out]
    (the checkpoint names); all-reduces its output when it is row-parallel (`tp`)."""

    def __init__(self, linear: nn.Linear, method: QuantMethod, quantize: bool) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        if quantize:
            weight, scale = method.quantize(linear.weight.data)
        else:  # filled by the loader from a pre-quantised checkpoint
            device = linear.weight.device
            weight = torch.empty(out_features, in_features, dtype=method.weight_dtype,
                                 device=device)
            scale = torch.ones(out_features, dtype=torch.float32, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = linear.bias
        self.method = method
        # the group it all-reduces over: a row-parallel layer's, unless the norm after it
        # sums (RowParallelLinear.reduce_output)
        self.tp: TPGroup | None = linear.tp if isinstance(linear, RowParallelLinear) \
            and linear.reduce_output else None
        # a merged layer's parts (Attention splits q|k|v by these)
        self.output_sizes: list[int] = getattr(linear, "output_sizes", [out_features])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.matmul(x, self.weight, self.weight_scale)
        if self.tp is not None:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def quantize_linears(model: nn.Module, method: QuantMethod, quantize: bool = True) -> list[str]:
    """Replaces every projection layer by a `QuantLinear` (quantising its weights, or
    leaving them for the loader when `quantize` is false); gives the replaced names."""
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in QUANTIZED_LAYERS]
    for name, linear in targets:
        parent_name, child = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), child, QuantLinear(linear, method, quantize))
    return [name for name, _ in targets]


def scale_layout(layout: WeightLayout, quantized: list[str]) -> WeightLayout:
    """Gives the slots of the `weight_scale` tensors of a pre-quantised checkpoint: each
    lands on the rows its weight lands on (a scalar, per-tensor scale covers them all)."""
    params = {f"{name}.weight" for name in quantized}
    scales: WeightLayout = {}
    for name, slot in layout.items():
        if slot.param not in params or not name.endswith(".weight"):
            continue
        # the rows the weight's source takes (a row-parallel slot's is slice(None): all)
        scales[f"{name}_scale"] = WeightSlot(f"{slot.param}_scale", slot.shape[:1],
                                             slot.index[:1], slot.source[:1], per_row=True)
    return scales
