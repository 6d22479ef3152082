"""A multi-node group's other pods (NODE_RANK > 0): run this node's workers, answer the pod's
probes, and exit when a worker does.

Every pod of a group runs the same rendered `kvpilot serve` command; on these pods it
lands here instead of starting a server. The rendered pod template probes /health
and /ready on the engine port, so they answer 200 while the workers run (the pool's
Service selects only node rank 0's pod, so no request is ever routed here). When a
worker exits, the process stops the others and exits 1, and Kubernetes restarts the
pod (a LeaderWorkerSet the whole group); when the driver stops them cleanly, it exits 0.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType

from kvpilot.engine.contracts.args import EngineArgs, ServerArgs
from kvpilot.engine.contracts.rendezvous import Rendezvous
from kvpilot.engine.executor.processes import WorkerProcesses

logger = logging.getLogger("kvpilot.serve")
READY_LINE = "kvpilot serve: worker pod (node rank {node}) answering probes on http://{host}:{port}"
SIGNAL_CHECK_S = 0.5


class _Probes(BaseHTTPRequestHandler):
    failure: str | None = None  # set on the class once a worker exits

    def do_GET(self) -> None:
        if self.path not in ("/health", "/ready"):
            self._answer(404, {"error": f"{self.path} is served by node rank 0's pod"})
        elif _Probes.failure is not None:
            self._answer(503, {"status": "worker failed", "reason": _Probes.failure})
        else:
            self._answer(200, {"status": "worker"})

    def _answer(self, code: int, body: dict[str, str]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Logs nothing: probes every few seconds would drown the workers' logs."""


def serve_worker_pod(args: EngineArgs, server_args: ServerArgs, rendezvous: Rendezvous) -> int:
    """Runs this node's workers until one exits or the pod is told to stop; gives 0 when
    told to stop or every worker left cleanly (the driver stopped them), else 1."""
    done = threading.Event()

    def on_exit(message: str) -> None:
        _Probes.failure = message
        done.set()

    workers = WorkerProcesses(args, rendezvous, rendezvous.local_ranks, on_exit)
    httpd = ThreadingHTTPServer((server_args.host, server_args.port), _Probes)
    threading.Thread(target=httpd.serve_forever, name="kvpilot-probes", daemon=True).start()
    host, port = httpd.server_address[:2]
    print(READY_LINE.format(node=rendezvous.node_rank, host=host, port=port), file=sys.stderr,
          flush=True)

    signalled = threading.Event()

    def on_signal(sig: int, _: FrameType | None) -> None:
        logger.info("signal %s: stopping the workers", sig)
        signalled.set()
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # Linux may hand the signal to another thread (the probes' server): the main thread runs
    # its handler only once it wakes, so it never sleeps for long
    while not done.wait(SIGNAL_CHECK_S):
        pass
    httpd.shutdown()
    workers.stop(grace=0.0)
    if signalled.is_set():
        return 0
    # the driver's stop step ends every worker with 0; anything else is a failure
    return 0 if all(code == 0 for code in workers.returncodes()) else 1
