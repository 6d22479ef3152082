"""Starting and stopping the engine core process, from the side of its launcher.

Torch-free: the launcher is the API server process (`kvpilot serve`), or the
supervisor of several (`--api-server-count`). The core's pipe carries its
`CoreReady` and then nothing: it stays open until the core process ends, so its
read end turns readable at that moment, in every process that holds a copy.
That is how an API server learns at once that the core died, whatever killed it.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.core_process.entry import (
    STACKS_SIGNAL,
    CoreConfig,
    CoreReady,
    CoreStartFailed,
    EngineBuilder,
    build_engine,
    run_engine_core,
)


class CoreStartError(RuntimeError):
    """The engine core process failed to start; the message says why."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused  # the engine refused its flags or model (not a crash)


@dataclass(frozen=True)
class CoreHandle:
    """What an API server needs to reach the core (passed to API server processes at spawn)."""

    address: str  # the core's ZeroMQ endpoint
    ready: CoreReady
    exits: Connection  # turns readable (end of file) when the core process ends


class CoreProcess:
    """The engine core process, started with `spawn` and not as a daemon."""

    def __init__(self, process: BaseProcess, pipe: Connection, address: str,
                 socket_dir: str) -> None:
        self.process = process
        self.pipe = pipe
        self.address = address
        self._socket_dir = socket_dir

    @classmethod
    def start(cls, engine_args: EngineArgs, host: str, http_port: int,
              log_level: str = "info", build: EngineBuilder = build_engine) -> CoreProcess:
        """Starts building the engine in a new process; `wait_ready` gives its handle."""
        socket_dir = tempfile.mkdtemp(prefix="kvpilot-core-")
        address = f"ipc://{socket_dir}/core.sock"
        context = multiprocessing.get_context("spawn")
        reader, writer = context.Pipe(duplex=False)
        process = context.Process(
            target=run_engine_core, name="kvpilot-engine-core",
            args=(CoreConfig(engine_args, address, host, http_port, log_level, build), writer))
        process.start()
        writer.close()  # the core's copy is now the only one: its end closes the pipe
        return cls(process, reader, address, socket_dir)

    def wait_ready(self, timeout: float | None = None) -> CoreHandle:
        """Gives the handle API servers connect with, once the engine is built; raises
        CoreStartError if the core exits first or takes longer than `timeout` seconds."""
        if not self.pipe.poll(timeout):
            raise CoreStartError(f"the engine core did not start within {timeout} s")
        try:
            first: CoreReady | CoreStartFailed = self.pipe.recv()
        except EOFError:
            self.process.join(5)
            raise CoreStartError("the engine core process exited while starting (exit code "
                                 f"{self.process.exitcode}): its log above says why") from None
        if isinstance(first, CoreStartFailed):
            if first.refused:
                raise CoreStartError(first.reason, refused=True)
            raise CoreStartError(f"the engine core could not start: {first.reason}")
        return CoreHandle(self.address, first, self.pipe)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the core (SIGTERM: it shuts its engine down; SIGKILL after `timeout` s, once
        it has logged every thread's stack: where it hung)."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        if self.process.is_alive() and self.process.pid is not None:
            print(f"kvpilot: the engine core did not stop within {timeout:.0f} s of SIGTERM; "
                  "its threads' stacks follow, then SIGKILL", file=sys.stderr, flush=True)
            os.kill(self.process.pid, STACKS_SIGNAL)
            self.process.join(1.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        self.pipe.close()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
