"""What the symmetric-memory all-reduce meets outside the fakes, on CPU: the torch it runs on
has the ops it calls with the arguments it passes (bench/allreduce_gpu_run.sh runs this under
the GPU image's torch 2.11 too), and a CPU engine of two ranks says its all-reduce stays on
gloo and why."""

from __future__ import annotations

import logging

import torch

from kvpilot.engine.parallel.all_reduce_choice import OPS
from kvpilot.engine.parallel.symm_mem_all_reduce import TorchSymmMem


def test_this_torch_has_the_ops_with_the_arguments_passed():
    """The ops TorchSymmMem calls positionally, as this torch declares them (2.13 on the CPU
    machine; bench/allreduce_gpu_run.sh runs this file under the GPU image's 2.11 too)."""
    import inspect

    import torch.distributed._symmetric_memory as symm_mem

    assert TorchSymmMem().missing() == []
    kinds = {op: [str(a.type) for a in getattr(torch.ops.symm_mem, op).default._schema.arguments]
             for op in OPS}
    assert kinds == {"one_shot_all_reduce_copy_out": ["Tensor", "Tensor", "str", "str", "Tensor"],
                     "two_shot_all_reduce_out": ["Tensor", "str", "str", "Tensor"]}
    assert list(inspect.signature(symm_mem.rendezvous).parameters) == ["tensor", "group"]
    assert {"dtype", "device"} <= set(inspect.signature(symm_mem.empty).parameters)


def test_a_cpu_engine_says_its_all_reduce_stays_on_gloo(caplog):
    from kvpilot.engine.entrypoints.llm import LLM

    with caplog.at_level(logging.INFO, "kvpilot.engine"):
        llm = LLM("tiny-llama", tensor_parallel_size=2, kv_cache_memory="8MiB", device="cpu")
    try:
        assert llm.engine.runner.ctx.tp.symm_mem is None  # type: ignore[attr-defined]
    finally:
        llm.engine.shutdown()
    assert "all-reduce: gloo for every message (no symmetric memory: device cpu: symmetric " \
           "memory needs CUDA GPUs)" in caplog.text
