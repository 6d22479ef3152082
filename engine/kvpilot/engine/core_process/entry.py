"""The engine core process's main: build the engine, bind the socket, say ready, serve.

Started by `launch.CoreProcess` with the `spawn` method (a fresh interpreter: no
CUDA state or locks copied from the parent) and not as a daemon, so it may
start processes of its own (tensor-parallel workers). It ignores SIGINT: a
Ctrl+C reaches the whole process group, and the API servers must drain first;
their launcher then stops it with SIGTERM. It also stops when its parent
process goes away.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import FrameType

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.engine_loop.engine_core import ServedEngine

logger = logging.getLogger(__name__)
SHUTDOWN_TRACEBACK_S = 8.0  # under launch.CoreProcess.stop's 10 s before SIGKILL
STACKS_SIGNAL = signal.SIGUSR1  # logs every thread's stack (a core that ignored SIGTERM)

# (engine args, HTTP host, HTTP port) -> the engine to serve; picklable (a module-level function)
EngineBuilder = Callable[[EngineArgs, str, int], ServedEngine]


def build_engine(engine_args: EngineArgs, host: str, http_port: int) -> ServedEngine:
    """Gives the engine `kvpilot serve` runs: `LLMEngine.from_engine_args`, and for a
    prefill/decode role its KV-transfer agent (on the HTTP port + KV_PORT_OFFSET)."""
    from kvpilot.engine.engine_loop.llm_engine import LLMEngine
    from kvpilot.engine.engine_loop.roles import attach_role

    return attach_role(LLMEngine.from_engine_args(engine_args), host, http_port)


@dataclass(frozen=True)
class CoreConfig:
    """What the core process is started with."""

    engine_args: EngineArgs
    address: str  # the ZeroMQ endpoint its ROUTER socket binds, e.g. ipc:///tmp/x/core.sock
    host: str  # the API servers' HTTP host and port: the KV agent listens beside them
    http_port: int
    log_level: str = "info"
    build: EngineBuilder = build_engine


@dataclass(frozen=True)
class CoreReady:
    """The core's first message on its pipe: the engine is built and the socket bound."""

    model: str  # what the API servers report as the model's root
    max_model_len: int
    vocab_size: int
    enable_lora: bool = False  # whether a request's `model` may name a LoRA adapter


@dataclass(frozen=True)
class CoreStartFailed:
    """The core's first message on its pipe when the engine could not be built."""

    reason: str
    # a ValueError: the flags, the topology or the model were refused (the reason names the
    # fix); else the engine crashed while starting
    refused: bool


def run_engine_core(config: CoreConfig, pipe: Connection) -> None:
    """Runs the core until its parent exits or SIGTERM; `pipe` carries `CoreReady` (or
    `CoreStartFailed`) and is closed only by this process's end."""
    import zmq

    from kvpilot.engine.core_process.proc import EngineCoreProc

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # see launch.CoreProcess.stop
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = config.build(config.engine_args, config.host, config.http_port)
    except ValueError as exc:  # refused: the launcher prints the reason, no traceback
        _exiting()
        pipe.send(CoreStartFailed(str(exc), refused=True))
        raise SystemExit(2) from exc
    except Exception as exc:
        logger.exception("the engine core could not start")
        _exiting()
        pipe.send(CoreStartFailed(f"{type(exc).__name__}: {exc}", refused=False))
        raise SystemExit(1) from exc
    # this process serves this one engine for its whole life: its start-up heap (model,
    # tokenizer, torch's state) goes out of the cyclic GC's walks on any device, as
    # `LLMEngine.freeze_gc_heap` does on CUDA for an engine in any process (a CPU core's
    # full collection walked it for ~110 ms, a stall of every request, under a flood)
    gc.collect()
    gc.freeze()
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.SNDHWM, 0)  # never drop an API server's outputs
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 1000)  # a CoreFailed still goes out on the way down
    try:
        socket.bind(config.address)
        pipe.send(CoreReady(config.engine_args.model, engine.model_config.max_model_len,
                            engine.model_config.vocab_size, config.engine_args.enable_lora))
        parent = multiprocessing.parent_process()
        EngineCoreProc(engine, socket, parent.sentinel if parent else None).run()
    finally:
        # a shutdown or exit that hangs (a peer rank gone silent) logs every thread's stack
        # before the launcher's SIGKILL (armed until the process ends)
        faulthandler.dump_traceback_later(SHUTDOWN_TRACEBACK_S)
        engine.shutdown()  # a role engine's KV agent, a parallel engine's workers
        socket.close()
        context.term()
        if config.address.startswith("ipc://"):  # its launcher may be gone (killed)
            shutil.rmtree(os.path.dirname(config.address.removeprefix("ipc://")),
                          ignore_errors=True)


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def _exiting() -> None:
    """Ignores SIGTERM from here on: the launcher stops a core that said it cannot start, and
    the handler's SystemExit, raised inside the interpreter's exit handlers (torch's
    finalisers), printed a traceback under the one-line refusal."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
