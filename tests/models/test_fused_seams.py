"""`use_fused_kernels` puts the Triton kernels into every seam of a model (CPU: the swap
itself; the kernels' numbers are the kernel tests' and the GPU model tests')."""

from __future__ import annotations

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.fused import use_fused_kernels
from kvpilot.engine.models.layers import Linear
from kvpilot.engine.models.loader import load_model
from kvpilot.kernels.w8a16_gemm import one_row_linear


def test_every_projection_and_the_lm_head_get_the_one_row_gemv(tiny_checkpoints):
    import torch

    config = ModelConfig.from_engine_args(EngineArgs(model=str(tiny_checkpoints("llama"))),
                                          torch.device("cpu"))
    model = load_model(config, "auto", "cpu", fused_kernels=False)
    projections = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, Linear)}
    assert projections == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    assert "one_row_gemv" in use_fused_kernels(model)
    assert all(m.matmul is one_row_linear for m in model.modules() if isinstance(m, Linear))
