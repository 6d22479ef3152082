"""The worker processes a node starts, and the watchdog that notices when one exits.

Workers are fresh interpreters (`python -m kvpilot.engine.executor.worker_process` with the
engine's own flags), not forks: no CUDA state or threads are inherited, and a
spawned engine-core process (itself a child) may start them too. Each learns its
rank and the rendezvous from its environment, in the names the operator renders for
multi-node groups (`contracts/rendezvous.py`). Each asks Linux to SIGTERM it when
the thread that started it ends, and leaves on its own when the driver's sockets
close, so no worker outlives its engine.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.rendezvous import (
    LOCAL_ADDR,
    MASTER_ADDR,
    MASTER_PORT,
    NNODES,
    NODE_RANK,
    WORLD_SIZE,
    Rendezvous,
)

logger = logging.getLogger(__name__)
WORKER_MODULE = "kvpilot.engine.executor.worker_process"
RANK_ENV = "KVPILOT_RANK"  # the worker's global rank
PARENT_ENV = "KVPILOT_PARENT_PID"  # the process that started it (checked after PDEATHSIG)
WATCH_INTERVAL_S = 0.2


def free_port() -> int:
    """Gives a free TCP port on 127.0.0.1 for a one-node world's store."""
    with socket.socket() as sock:
        sock.bind((LOCAL_ADDR, 0))
        return sock.getsockname()[1]


def rendezvous_env(rendezvous: Rendezvous) -> dict[str, str]:
    """Gives the env a rank reads its group from (what a multi-node pod gets rendered)."""
    return {MASTER_ADDR: rendezvous.master_addr, MASTER_PORT: str(rendezvous.master_port),
            WORLD_SIZE: str(rendezvous.world_size), NNODES: str(rendezvous.nnodes),
            NODE_RANK: str(rendezvous.node_rank)}


class WorkerProcesses:
    """Worker processes of this node; `on_exit` is called once, from the watchdog thread,
    with a message naming the first worker that exited."""

    def __init__(self, args: EngineArgs, rendezvous: Rendezvous, ranks: Iterable[int],
                 on_exit: Callable[[str], None]) -> None:
        self.on_exit = on_exit
        self.exited: str | None = None  # the first exit, once seen
        self._stopping = threading.Event()
        base = {**os.environ, **rendezvous_env(rendezvous), PARENT_ENV: str(os.getpid())}
        argv = [sys.executable, "-m", WORKER_MODULE, *args.to_cli()]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for rank in ranks:
            self.procs[rank] = subprocess.Popen(argv, env={**base, RANK_ENV: str(rank)})
        self._watchdog = threading.Thread(target=self._watch, name="kvpilot-workers",
                                          daemon=True)
        self._watchdog.start()

    def _exit_message(self) -> str | None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                if code == 0:
                    return f"parallel worker rank {rank} (pid {proc.pid}) was stopped"
                how = (f"was killed by {signal.Signals(-code).name}" if code < 0
                       else f"exited with code {code}")
                return (f"parallel worker rank {rank} (pid {proc.pid}) {how}: the engine "
                        "cannot run without it; restart the server")
        return None

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            message = self._exit_message()
            if message is not None and not self._stopping.is_set():
                self.exited = message
                logger.error("%s", message)
                self.on_exit(message)
                return

    def wait_for_exit(self, timeout: float) -> str | None:
        """Gives the first worker exit seen within `timeout` seconds, or None."""
        deadline = time.monotonic() + timeout
        while True:
            message = self.exited or self._exit_message()
            if message is not None or time.monotonic() >= deadline:
                return message
            time.sleep(WATCH_INTERVAL_S)

    def expect_exits(self) -> None:
        """Stops the watchdog before the workers are told to leave (their exit is no failure)."""
        self._stopping.set()

    def returncodes(self) -> list[int | None]:
        """Gives each worker's exit status (None while it runs)."""
        return [proc.poll() for proc in self.procs.values()]

    def stop(self, grace: float = 10.0) -> None:
        """Gives the workers `grace` seconds to leave (after a stop step), then SIGTERMs
        and finally SIGKILLs what is left, and joins the watchdog."""
        self._stopping.set()
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._watchdog is not threading.current_thread():  # an exit listener may stop us
            self._watchdog.join(WATCH_INTERVAL_S * 10)
