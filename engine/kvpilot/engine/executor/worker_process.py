"""A worker process of a parallel engine: joins the engine's groups, loads its shard (of
its pipeline stage), and runs every step until the driver says stop (or goes away).
Workers of the driver's stage receive each step from the driver; the other stages'
from the stage before them, with its activations, and pass on what they compute.

Started by `parallel.processes.WorkerProcesses` as `python -m
kvpilot.engine.executor.worker_process <engine flags>`, with its rank and the rendezvous in
its environment. It builds the same ModelRunner the driver does, over its shard.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys

import torch

from kvpilot.engine.contracts.args import EngineArgs, add_dataclass_args, from_namespace
from kvpilot.engine.contracts.rendezvous import Rendezvous
from kvpilot.engine.executor.pipe_channel import PipeChannel
from kvpilot.engine.executor.processes import PARENT_ENV, RANK_ENV
from kvpilot.engine.executor.step_channel import ReceivedLoad, StepChannel
from kvpilot.engine.parallel.config import ParallelConfig
from kvpilot.engine.parallel.distributed import (
    RankContext,
    destroy_distributed,
    init_distributed,
)
from kvpilot.engine.parallel.stage import Intermediate
from kvpilot.engine.parallel.symm_mem_all_reduce import with_symm_mem
from kvpilot.engine.worker.device import resolve_device
from kvpilot.engine.worker.kv_shards import write_blocks
from kvpilot.engine.worker.model_runner import ModelRunner
from kvpilot.engine.worker.step_batch import unpack_step

logger = logging.getLogger("kvpilot.worker")
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Has Linux SIGTERM this worker when its parent ends (even by SIGKILL); a terminal's
    Ctrl+C is the driver's to handle (it drains, then stops the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = os.environ.get(PARENT_ENV)
    if parent is not None and os.getppid() != int(parent):
        sys.exit("kvpilot worker: the process that started it is gone")


def run_worker(args: EngineArgs, rank: int, rendezvous: Rendezvous) -> None:
    """Joins as `rank`, then runs steps until the driver sends stop."""
    from kvpilot.engine.models.config import ModelConfig

    parallel = ParallelConfig.from_engine_args(args)
    device = resolve_device(args.device)
    if device.type == "cpu":  # the node's ranks share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // rendezvous.ranks_per_node))
    torch.manual_seed(args.seed)
    model_config = ModelConfig.from_engine_args(args, device)
    ctx = with_symm_mem(init_distributed(parallel, rendezvous, rank, device.type,
                                         model_config.num_layers),
                        args, model_config, rendezvous)
    runner: ModelRunner | None = None
    try:
        runner = ModelRunner(args, model_config, ctx.device, ctx.tp, ctx.min_over_ranks,
                             ctx.stage)
        logger.info("worker rank %d (pipeline stage %d, layers %d-%d) ready on %s", rank,
                    ctx.stage.rank, ctx.stage.layers.start, ctx.stage.layers.stop - 1, ctx.device)
        if ctx.stage.size > 1:
            _run_stage(ctx, runner, PipeChannel(ctx, model_config.hidden_size,
                                                model_config.dtype))
            return
        channel = StepChannel(ctx)
        heads = ctx.tp.kv_heads(model_config.num_kv_heads)
        while (step := channel.receive()) is not None:
            if isinstance(step, ReceivedLoad):  # pulled KV: this rank's heads of it
                write_blocks(runner.kv_caches, step.block_ids, step.data, heads,
                             model_config.num_kv_heads)
                continue
            runner.run(unpack_step(step.header, step.buf, step.host), step.prev_tokens)
    finally:
        if runner is not None:  # graphs before groups (see DecodeGraphs.release)
            runner.release_graphs()
        destroy_distributed()


def _run_stage(ctx: RankContext, runner: ModelRunner, pipe: PipeChannel) -> None:
    """Runs this pipeline stage's part of every step until stop, then passes the stop on."""
    channel = StepChannel(ctx) if ctx.stage.is_first else None
    while True:
        if channel is not None:  # a worker of the driver's stage: the driver broadcasts
            step = channel.receive()
            if step is None:
                break
            assert not isinstance(step, ReceivedLoad)  # decode roles run one stage (config)
            header, buf, host, received = step.header, step.buf, step.host, None
        else:
            got = pipe.receive()
            if got is None:
                break
            header, buf, host, received = got
        out = runner.run_stage(unpack_step(header, buf, host), received)
        if isinstance(out, Intermediate):
            pipe.send_next(header, buf, out)
        elif ctx.tp.is_first and header.num_rows:
            pipe.send_logits(out)
    pipe.send_stop_next()
    pipe.flush()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    parser = argparse.ArgumentParser(prog="kvpilot-worker")
    add_dataclass_args(parser, EngineArgs)
    args = from_namespace(EngineArgs, parser.parse_args(argv))
    rank = int(os.environ[RANK_ENV])
    rendezvous = Rendezvous.from_env(os.environ, args.tensor_parallel_size
                                     * args.pipeline_parallel_size)
    if rendezvous is None:
        print("kvpilot worker: NODE_RANK and the rendezvous env are unset: workers are "
              "started by `kvpilot serve`", file=sys.stderr)
        return 2
    try:
        run_worker(args, rank, rendezvous)
    except RuntimeError as exc:  # the driver went away mid-collective: leave quietly
        logger.error("worker rank %d stops: %s", rank, str(exc).splitlines()[0])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
