"""Applies a re-read manifest to the running local fleet: start grown pools, drain shrunk ones.

The router reads its engines from a file this module rewrites atomically
(`--instances-file`). Scale-up: start the new engines, wait until they answer
/health, then add them to the file. Scale-down: pick the replicas the operator
would remove (least requests in flight first, from their own /metrics), drop
them from the file, wait until the router has re-read it, then SIGTERM them:
each engine finishes what it holds and exits 0.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.operator.autoscale.pods import removal_order
from kvpilot.operator.autoscale.scrape import scrape
from kvpilot.operator.local.plan import LocalProcess, instances_text, plan_local
from kvpilot.operator.local.reload import diff_plan, unreloadable_field
from kvpilot.operator.local.supervisor import Supervisor, free_port


def write_instances(path: Path, engines: list[LocalProcess]) -> None:
    """Replaces the router's instances file in one rename, so no reader sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(instances_text(engines) + "\n")
    os.replace(tmp, path)


def refresh_interval(router: LocalProcess) -> float:
    """Gives the router's --refresh-interval (its default when the argv has none)."""
    argv = router.argv
    if "--refresh-interval" in argv:
        return float(argv[argv.index("--refresh-interval") + 1])
    return RouterArgs.refresh_interval


@dataclass
class Scaler:
    """The running fleet's manifest and the means to move it to an edited one."""

    supervisor: Supervisor
    manifest: dict[str, Any]
    router: LocalProcess
    instances_file: Path
    ready_timeout: float
    drain_timeout: float
    fleet_secret_file: str | None = None  # the one every process of the fleet reads
    model_dir: str | None = None  # where the engines read the weights (kvpilot up --model-dir)

    def publish(self, leaving: frozenset[str] = frozenset()) -> None:
        """Writes the running engines, less `leaving`, to the router's instances file."""
        write_instances(self.instances_file,
                        [e for e in self.supervisor.engines() if e.name not in leaving])

    def reload(self, manifest: dict[str, Any],
               interrupted: Callable[[], bool] = lambda: False) -> list[str]:
        """Scales the fleet to `manifest`; gives one line per pool it changed.

        Raises ValueError naming the field when more than replica counts changed.
        """
        if (changed := unreloadable_field(self.manifest, manifest)) is not None:
            raise ValueError(f"kvpilot up reloads only replica counts; restart for {changed}")
        planned, _ = plan_local(manifest, free_port, self.router.port,
                                instances_file=str(self.instances_file),
                                fleet_secret_file=self.fleet_secret_file,
                                model_dir=self.model_dir)
        actions = diff_plan(self.supervisor.engines(), planned)
        before = {p: sum(e.pool == p for e in self.supervisor.engines())
                  for p in {*actions.stop, *(e.pool for e in actions.start)}}
        self._start(actions.start, interrupted)
        codes = self._drain(actions.stop)
        self.manifest = manifest
        lines = []
        for pool, count in sorted(before.items()):
            now = sum(e.pool == pool for e in self.supervisor.engines())
            exits = ", ".join(f"{name} exited {code}" for name, code in sorted(codes.items())
                              if name.startswith(pool + "-"))
            lines.append(f"{pool}: {count} -> {now} replica(s)" + (f"; {exits}" if exits else ""))
        return lines

    def _start(self, new: list[LocalProcess], interrupted: Callable[[], bool]) -> None:
        """Starts engines, waits until they serve, then tells the router about them."""
        if not new:
            return
        for process in new:
            self.supervisor.start(process)
        try:
            self.supervisor.wait_ready(self.ready_timeout, {}, interrupted, only=new)
        except (RuntimeError, TimeoutError):
            self.supervisor.retire([p.name for p in new], grace=5.0)
            raise
        self.publish()

    def _drain(self, stop: dict[str, int]) -> dict[str, int]:
        """Removes `count` replicas per pool, least loaded first; gives their exit codes."""
        victims: list[str] = []
        for pool, count in stop.items():
            members = [e for e in self.supervisor.engines() if e.pool == pool]
            samples = asyncio.run(scrape({e.name: f"{e.url}/metrics" for e in members}))
            victims += removal_order(samples)[:count]
        if not victims:
            return {}
        self.publish(leaving=frozenset(victims))
        # The router re-reads the file each refresh interval (after a scrape that may take
        # as long again): two intervals and it no longer routes there. What it sent
        # before finishes during the engine's drain.
        time.sleep(2 * refresh_interval(self.router) + 0.5)
        return self.supervisor.retire(victims, self.drain_timeout)
