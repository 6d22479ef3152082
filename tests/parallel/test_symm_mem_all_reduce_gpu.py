"""The symmetric-memory all-reduce on 2 GPUs: it sets itself up, and gives exactly what
NCCL's all-reduce gives (bf16 and fp32, 8 KiB to 4 MiB, eagerly and replayed from a
captured CUDA graph); the fused all-reduce + residual add + RMSNorm kernel gives exactly
the ranks' inputs summed in rank order followed by the rmsnorm kernel (at 2 GPUs that sum
is NCCL's; at 4 too, on 4 GPUs), eagerly and from a graph; the TP=2 engine with it on decodes from CUDA graphs through
both and matches TP=1 under the top-5 rule of test_parallel_gpu.py."""

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
from kvpilot.engine.entrypoints.llm import LLM
from kvpilot.engine.parallel.all_reduce_choice import ONE_SHOT
from kvpilot.engine.parallel.groups import TPGroup
from kvpilot.engine.parallel.symm_mem_all_reduce import SEND_WORLD_SIZES, SENT

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


FUSED_ROWS = [1, 7, 64, 200]  # 200: more rows than the kernel's programs


def compare_fused(tp: TPGroup, rank: int) -> list[str]:
    """Gives the mismatches of the fused kernel against the ranks' inputs gathered, summed in
    rank order in float32 and put through the rmsnorm kernel, eager (rows of FUSED_ROWS in
    turn) and replayed from a graph."""
    import torch.distributed as dist

    from kvpilot.kernels.rmsnorm import rms_norm

    assert tp.symm_mem is not None and tp.symm_mem.fused
    errors = []

    def unfused(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor):
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x.contiguous(), group=tp.group)
        total = parts[0].float()
        for part in parts[1:]:
            total += part.float()
        return rms_norm(total.to(x.dtype), weight, 1e-5, residual)

    def differs(got, want) -> str | None:
        for name, g, w in zip(("out", "residual"), got, want, strict=True):
            if not torch.equal(g, w):
                return f"{name} max diff {(g.float() - w.float()).abs().max().item()}"
        return None

    for dtype in (torch.bfloat16, torch.float32):
        for rows in FUSED_ROWS:
            gen = torch.Generator(device="cuda").manual_seed(100 * rows)  # shared by ranks
            residual = torch.randn(rows, 4096, dtype=dtype, device="cuda", generator=gen)
            weight = torch.randn(4096, dtype=dtype, device="cuda", generator=gen)
            gen.manual_seed(1000 * rank + rows)
            x = torch.randn(rows, 4096, dtype=dtype, device="cuda", generator=gen)
            for name, data in (("random", x), ("integer", (x * 8).round())):
                got = tp.all_reduce_add_rms_norm(data, residual, weight, 1e-5)
                if got is None:
                    errors.append(f"fused {name} {dtype} {rows} rows: not taken")
                    continue
                if (diff := differs(got, unfused(data, residual, weight))) is not None:
                    errors.append(f"fused {name} {dtype} {rows} rows: {diff}")
    from kvpilot.kernels.w8a16_gemm import gemv, skinny_linear

    # rows the projection sent (the GEMV one, the tiled kernel more), several calls in a row,
    # at the group sizes that send
    for dtype in (torch.bfloat16, torch.float32) if tp.size in SEND_WORLD_SIZES else ():
        for call, rows in enumerate((1, 1, 5, 64, 1, 16, 16)):
            gen = torch.Generator(device="cuda").manual_seed(10 * rank + call)
            a = torch.randn(rows, 2048, dtype=dtype, device="cuda", generator=gen)
            w = torch.randn(4096, 2048, dtype=dtype, device="cuda", generator=gen) / 32
            gen.manual_seed(call)
            residual = torch.randn(rows, 4096, dtype=dtype, device="cuda", generator=gen)
            weight = torch.randn(4096, dtype=dtype, device="cuda", generator=gen)
            sent = tp.symm_mem.linear_send(a, w)
            if sent is None:
                errors.append(f"linear_send {dtype} {rows} rows: not taken")
                continue
            got = tp.all_reduce_add_rms_norm(sent, residual, weight, 1e-5)
            product = gemv(a, w) if rows == 1 else skinny_linear(a, w)
            if (diff := differs(got, unfused(product, residual, weight))) is not None:
                errors.append(f"linear_send {dtype} call {call} ({rows} rows): {diff}")
    x = torch.zeros(8, 4096, dtype=torch.bfloat16, device="cuda")
    residual, weight = torch.zeros_like(x), torch.ones(4096, dtype=x.dtype, device="cuda")
    tp.all_reduce_add_rms_norm(x, residual, weight, 1e-5)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, stream = x, residual
        for _ in range(3):  # chained, as a decode graph's layers run them
            fused = tp.all_reduce_add_rms_norm(out, stream, weight, 1e-5)
            assert fused is not None
            out, stream = fused
    for step in range(3):
        gen = torch.Generator(device="cuda").manual_seed(7 * rank + step)
        x.copy_((torch.randn(x.shape, device="cuda", generator=gen) * 8).round())
        gen.manual_seed(step)
        residual.copy_((torch.randn(x.shape, device="cuda", generator=gen) * 8).round())
        want_out, want_stream = x, residual
        for _ in range(3):
            want_out, want_stream = unfused(want_out, want_stream, weight)
        graph.replay()
        torch.cuda.synchronize()
        if (diff := differs((out, stream), (want_out, want_stream))) is not None:
            errors.append(f"fused graph replay {step}: {diff}")
    graph.reset()
    return errors


def rank_main(rank: int, port: int, out: str, world: int = 2) -> None:
    """One rank: joins, sets the path up, compares, writes its findings to `out`.rank."""
    from kvpilot.engine.contracts.rendezvous import Rendezvous
    from kvpilot.engine.parallel import symm_mem_all_reduce
    from kvpilot.engine.parallel.config import ParallelConfig
    from kvpilot.engine.parallel.distributed import destroy_distributed, init_distributed
    from kvpilot.engine.parallel.symm_mem_all_reduce import (
        AllReduceSettings,
        TorchSymmMem,
        setup_symm_mem,
    )

    # fused slots as large as the largest message, so the kernel runs at every size of
    # FUSED_ROWS (200 rows: more than its programs), not only the engine's decode sizes
    symm_mem_all_reduce.FUSED_MAX_BYTES = dict.fromkeys((2, 4), max(SIZES))

    result: dict = {"errors": []}
    try:
        ctx = init_distributed(ParallelConfig(world), Rendezvous.local(world, port), rank,
                               "cuda", 1)
        settings = AllReduceSettings(False, max(SIZES), torch.bfloat16)
        tp = setup_symm_mem(ctx.tp, settings, ctx.device, range(world), ctx.min_over_ranks,
                            TorchSymmMem())
        result["enabled"] = tp.symm_mem is not None and tp.symm_mem.fused
        if tp.symm_mem is not None:
            result["errors"] = (compare(tp, rank) if world == 2 else []) + \
                compare_fused(tp, rank)
        destroy_distributed()
    except Exception:  # the test reads it from the file
        result["errors"].append(traceback.format_exc())
    Path(f"{out}.{rank}").write_text(json.dumps(result))


@pytest.mark.parametrize("world", [2, 4])
def test_symm_mem_all_reduce_equals_nccl(tmp_path: Path, world: int):
    need_gpus(world)
    from kvpilot.engine.executor.processes import free_port

    port, out = free_port(), str(tmp_path / "result")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, port, out, world)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(150)
        if p.is_alive():
            p.kill()
    results = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    assert [r.get("enabled") for r in results] == [True] * world, results
    assert [r["errors"] for r in results] == [[]] * world


def test_tp2_engine_decodes_through_symm_mem_and_matches_tp1(tmp_path: Path):
    need_gpus(2)
    path = model_dir(tmp_path / "llama", LLAMA_SHAPE)
    batch = prompts(LLAMA_SHAPE["vocab_size"])
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    try:
        symm = llm.engine.runner.ctx.tp.symm_mem  # type: ignore[attr-defined]
        # on by default, and the decode graphs captured their all-reduces through it: at
        # up to 64 rows (here every graph's) the projections' kernels sent their rows
        assert symm is not None and symm.calls[ONE_SHOT] > 0 and symm.calls[SENT] > 0
        greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outputs = llm.generate(batch, greedy)
        alone = llm.generate(batch[:1], greedy)  # decodes at batch 1: the GEMV's sent row
        assert llm.get_stats().graph_steps > 0
    finally:
        llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    assert_top5(path, batch, [o.outputs[0].token_ids for o in outputs])
    assert_top5(path, batch[:1], [o.outputs[0].token_ids for o in alone])
