"""Starts the local fleet's processes, waits until they are ready, restarts the ones that die
(with back-off, as a Deployment would), and stops them cleanly."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvpilot.engine.contracts.args import KV_PORT_OFFSET
from kvpilot.operator.local.plan import LOCALHOST, LocalProcess
from kvpilot.operator.local.restarts import Restart, schedule

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Has Linux SIGTERM this child if `kvpilot up` dies, even by SIGKILL (no orphans)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((LOCALHOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """Gives a free 127.0.0.1 port whose +1000 neighbour (the KV agent's) is free too."""
    for _ in range(100):
        with socket.socket() as sock:
            sock.bind((LOCALHOST, 0))
            port = sock.getsockname()[1]
        if port + KV_PORT_OFFSET < 65536 and _bindable(port + KV_PORT_OFFSET):
            return port
    raise RuntimeError("found no free port pair on 127.0.0.1")


class Supervisor:
    """The running processes of one local fleet; logs go to files under `log_dir`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.running: list[tuple[LocalProcess, subprocess.Popen[bytes]]] = []
        self._started: dict[str, float] = {}  # name -> monotonic start of its current run
        self._restarts: dict[str, Restart] = {}  # name -> its latest restart (scheduled or done)
        self._waiting: set[str] = set()  # names that died and wait for their restart

    def start(self, process: LocalProcess) -> None:
        """Starts one process in its own session, so a terminal's Ctrl-C reaches only us."""
        self.running.append((process, self._spawn(process)))

    def _spawn(self, process: LocalProcess) -> subprocess.Popen[bytes]:
        # Appends: a replica name reused after a scale-down (or a restart) keeps its log.
        log = open(self.log_dir / f"{process.name}.log", "ab")  # noqa: SIM115 (child owns it)
        popen = subprocess.Popen(process.argv, env={**os.environ, **process.env},
                                 stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                 preexec_fn=_die_with_parent)
        log.close()
        self._started[process.name] = time.monotonic()
        return popen

    def tend(self, now: float | None = None) -> list[str]:
        """Restarts the processes that exited on their own, each once its back-off passed
        (`restarts.schedule`), on the same ports; gives one line per exit and restart."""
        now = time.monotonic() if now is None else now
        lines = []
        for index, (process, popen) in enumerate(self.running):
            if popen.poll() is None:
                continue
            name = process.name
            if name not in self._waiting:
                restart = schedule(self._restarts.get(name), now,
                                   now - self._started.get(name, now))
                self._restarts[name] = restart
                self._waiting.add(name)
                lines.append(f"{name} exited with code {popen.returncode}; restart "
                             f"#{restart.count} in {restart.delay:.0f}s; last log lines:\n"
                             f"{self.log_tail(process, 5)}")
            elif now >= self._restarts[name].due:
                self._waiting.discard(name)
                self.running[index] = (process, self._spawn(process))
                lines.append(f"{name} restarted (#{self._restarts[name].count})")
        return lines

    def log_tail(self, process: LocalProcess, lines: int = 20) -> str:
        """Gives the last lines of a process's log."""
        path = self.log_dir / f"{process.name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def engines(self) -> list[LocalProcess]:
        """Gives the running engine processes (everything but the router)."""
        return [p for p, _ in self.running if p.role != "router"]

    def wait_ready(self, timeout: float, path_for: dict[str, str],
                   interrupted: Callable[[], bool] = lambda: False,
                   only: list[LocalProcess] | None = None) -> None:
        """Waits until every process (or those in `only`) answers its readiness path.

        Raises naming the laggard.
        """
        deadline = time.monotonic() + timeout
        pending = [item for item in self.running if only is None or item[0] in only]
        with httpx.Client(timeout=2.0) as client:
            while pending:
                process, popen = pending[0]
                if popen.poll() is not None:
                    raise RuntimeError(f"{process.name} exited with code {popen.returncode}:\n"
                                       f"{self.log_tail(process)}")
                try:
                    path = path_for.get(process.role, "/health")
                    if client.get(process.url + path).status_code == 200:
                        pending.pop(0)
                        continue
                except httpx.HTTPError:
                    pass
                if interrupted():
                    raise InterruptedError("interrupted while waiting for the fleet")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{process.name} not ready after {timeout:.0f}s "
                                       f"(--timeout):\n{self.log_tail(process)}")
                time.sleep(0.1)

    def retire(self, names: list[str], grace: float) -> dict[str, int]:
        """SIGTERMs these processes (engines drain), waits, gives each one's exit code.

        What outlives `grace` is SIGKILLed (its code is then -9). Retired processes
        leave `running`, so their exit is not mistaken for a crash.
        """
        retired = [(p, popen) for p, popen in self.running if p.name in names]
        for _, popen in retired:
            with contextlib.suppress(ProcessLookupError):
                popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        codes: dict[str, int] = {}
        for process, popen in retired:
            try:
                codes[process.name] = popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                popen.kill()
                codes[process.name] = popen.wait()
        self.running = [item for item in self.running if item[0].name not in names]
        for name in names:  # a retired replica that had died is not restarted
            self._waiting.discard(name)
            self._restarts.pop(name, None)
        return codes

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERMs the router first, then the engines; SIGKILLs what outlives `grace`."""
        order = sorted(self.running, key=lambda item: item[0].role != "router")
        for _, popen in order:
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _, popen in order:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(max(0.0, deadline - time.monotonic()))
            if popen.poll() is None:
                popen.kill()
                popen.wait()
        self.running.clear()
