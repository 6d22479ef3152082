"""The symmetric-memory all-reduce on 2 GPUs: it sets itself up, and gives exactly what
NCCL's all-reduce gives (bf16 and fp32, 8 KiB to 4 MiB, eagerly and replayed from a
captured CUDA graph); the TP=2 engine with it on decodes from CUDA graphs through it and
matches TP=1 under the top-5 rule of test_parallel_gpu.py."""

from __future__ import annotations

import gc
import json
import multiprocessing
import traceback
from pathlib import Path

import pytest
import torch
from test_parallel_gpu import (
    ENGINE,
    LLAMA_SHAPE,
    NEW_TOKENS,
    assert_top5,
    model_dir,
    need_gpus,
    prompts,
)

from kvpilot.engine.contracts.sampling_params import SamplingParams
from kvpilot.engine.llm import LLM
from kvpilot.engine.parallel.all_reduce_choice import ONE_SHOT
from kvpilot.engine.parallel.groups import TPGroup

pytestmark = pytest.mark.gpu
KIB = 1024
SIZES = [8 * KIB, 64 * KIB, 512 * KIB, 4096 * KIB]  # bytes of one message
GRAPH_SIZES = [8 * KIB, 512 * KIB]


def compare(tp: TPGroup, rank: int) -> list[str]:
    """Gives the mismatches of one rank: symmetric memory against NCCL, eager and in a graph."""
    import torch.distributed as dist

    assert tp.symm_mem is not None
    errors = []
    for dtype in (torch.bfloat16, torch.float32):
        for nbytes in SIZES:
            gen = torch.Generator(device="cuda").manual_seed(1000 * rank + nbytes)
            x = torch.randn(nbytes // dtype.itemsize // 1024, 1024, dtype=dtype,
                            device="cuda", generator=gen)
            whole = (x * 8).round()  # small integers: exact in any summation order
            for name, data in (("random", x), ("integer", whole)):
                want, got = data.clone(), data.clone()
                dist.all_reduce(want, group=tp.group)
                assert tp.symm_mem.choose(got) == ONE_SHOT  # 2 ranks: one-shot up to 4 MiB
                tp.all_reduce(got)
                if not torch.equal(got, want):
                    errors.append(f"eager {name} {dtype} {nbytes} B: max diff "
                                  f"{(got.float() - want.float()).abs().max().item()}")
    for nbytes in GRAPH_SIZES:
        static = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        tp.all_reduce(static)  # warm up outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(3):  # back to back, as a decode graph's layers do
                tp.all_reduce(static)
        for step in range(3):
            gen = torch.Generator(device="cuda").manual_seed(7 * rank + step)
            fresh = torch.randn(static.shape, dtype=torch.bfloat16, device="cuda",
                                generator=gen)
            want = fresh.clone()
            for _ in range(3):
                dist.all_reduce(want, group=tp.group)
            static.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(static, want):
                errors.append(f"graph replay {step} of {nbytes} B: max diff "
                              f"{(static.float() - want.float()).abs().max().item()}")
        graph.reset()
    return errors


def rank_main(rank: int, port: int, out: str) -> None:
    """One rank: joins, sets the path up, compares, writes its findings to `out`.rank."""
    from kvpilot.engine.contracts.rendezvous import Rendezvous
    from kvpilot.engine.parallel.config import ParallelConfig
    from kvpilot.engine.parallel.distributed import destroy_distributed, init_distributed
    from kvpilot.engine.parallel.symm_mem_all_reduce import (
        AllReduceSettings,
        TorchSymmMem,
        setup_symm_mem,
    )

    result: dict = {"errors": []}
    try:
        ctx = init_distributed(ParallelConfig(2), Rendezvous.local(2, port), rank, "cuda", 1)
        settings = AllReduceSettings(False, max(SIZES), torch.bfloat16)
        tp = setup_symm_mem(ctx.tp, settings, ctx.device, range(2), ctx.min_over_ranks,
                            TorchSymmMem())
        result["enabled"] = tp.symm_mem is not None
        if tp.symm_mem is not None:
            result["errors"] = compare(tp, rank)
        destroy_distributed()
    except Exception:  # the test reads it from the file
        result["errors"].append(traceback.format_exc())
    Path(f"{out}.{rank}").write_text(json.dumps(result))


def test_symm_mem_all_reduce_equals_nccl(tmp_path: Path):
    need_gpus(2)
    from kvpilot.engine.parallel.processes import free_port

    port, out = free_port(), str(tmp_path / "result")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
        if p.is_alive():
            p.kill()
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert [r.get("enabled") for r in results] == [True, True], results
    assert [r["errors"] for r in results] == [[], []]


def test_tp2_engine_decodes_through_symm_mem_and_matches_tp1(tmp_path: Path):
    need_gpus(2)
    path = model_dir(tmp_path / "llama", LLAMA_SHAPE)
    batch = prompts(LLAMA_SHAPE["vocab_size"])
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    try:
        symm = llm.engine.runner.ctx.tp.symm_mem  # type: ignore[attr-defined]
        # on by default, and the decode graphs captured their all-reduces through it
        assert symm is not None and symm.calls[ONE_SHOT] > 0
        outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                     ignore_eos=True))
        assert llm.get_stats().graph_steps > 0
    finally:
        llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert_top5(path, batch, [o.outputs[0].token_ids for o in outputs])
