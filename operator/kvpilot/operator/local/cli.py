"""The `kvpilot up` subcommand: run an InferenceModel's fleet as local processes."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

# The repository's example (operator/kvpilot/operator/local/cli.py -> the checkout's root).
DEFAULT_MANIFEST = Path(__file__).resolve().parents[4] / "examples" / "tiny-cpu.yaml"
ONCE_PROMPT = "Say hello in five words."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the flags of `kvpilot up`."""
    parser.add_argument("file", nargs="?", default=str(DEFAULT_MANIFEST),
                        help="InferenceModel manifest (default: the checkout's examples/tiny-cpu.yaml)")
    parser.add_argument("--port", type=int, default=8080, help="router port on 127.0.0.1")
    parser.add_argument("--once", action="store_true",
                        help="send one chat request, print the answer, stop everything, exit")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds every process gets to become ready")
    parser.add_argument("--log-dir", default=None,
                        help="where each process's log goes (default: a temporary directory)")
    parser.add_argument("--model-dir", default=None, metavar="DIR",
                        help="serve spec.model.source's weights from this directory (what "
                             "`kvpilot fetch ORG/NAME --local-dir DIR` wrote): kvpilot up "
                             "downloads and mounts nothing, so an hf://, pvc:// or oci:// "
                             "source needs it")
    parser.add_argument("--drain-timeout", type=float, default=120.0,
                        help="seconds a removed replica gets to finish its requests on a "
                             "scale-down before it is killed")


def write_fleet_secret() -> Path:
    """Gives a new file (mode 0600) holding a fresh fleet secret, for every process to read."""
    from kvpilot.engine.contracts.fleet_secret import FleetSecret

    fd, path = tempfile.mkstemp(prefix="kvpilot-fleet-secret-")  # created 0600
    with os.fdopen(fd, "w") as out:
        out.write(FleetSecret.generate().secret.hex() + "\n")
    return Path(path)


def check_api_key(manifest: dict[str, Any]) -> None:
    """Raises ValueError when the manifest asks for an API key that the local processes,
    which cannot read a Secret, would not get from $KVPILOT_API_KEY."""
    from kvpilot.engine.contracts.args import API_KEY_ENV, resolve_api_key

    ref = ((manifest.get("spec") or {}).get("auth") or {}).get("apiKeySecretRef")
    if ref and resolve_api_key(None) is None:
        raise ValueError(f"spec.auth.apiKeySecretRef names Secret {ref.get('name')!r}, which "
                         f"kvpilot up cannot read: export {API_KEY_ENV}=<the key> (every "
                         "process inherits it), or remove spec.auth to run the API open")


def scale_hint(file: str, pid: int) -> str:
    """Gives the line that tells how to scale the running fleet: edit the manifest, then
    SIGHUP; a tracked example is copied first (the README's way), not edited in place."""
    path = Path(file)
    if path.resolve().parent == DEFAULT_MANIFEST.parent:
        copy = f"my-{path.name}"
        return (f"  scale: {file} is a tracked example: copy it (cp {file} {copy}), run "
                f"kvpilot up {copy}, then edit the copy's replicas and send that kvpilot up "
                "a SIGHUP (kill -HUP PID)")
    return f"  scale: edit the pools' replicas in {file}, then: kill -HUP {pid}"


def _once(url: str, model: str) -> tuple[str, list[str]]:
    """Gives the answer to one greedy chat request through the router, and the URLs of the
    engines that served it (the router's served-by header: prefill first when disaggregated)."""
    import httpx

    from kvpilot.engine.contracts.args import resolve_api_key
    from kvpilot.engine.contracts.router_args import SERVED_BY_HEADER

    body = {"model": model, "messages": [{"role": "user", "content": ONCE_PROMPT}],
            "max_tokens": 24, "temperature": 0}
    key = resolve_api_key(None)  # the fleet's processes inherit $KVPILOT_API_KEY
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"} if key else {})
    response.raise_for_status()
    served = [u for u in response.headers.get(SERVED_BY_HEADER, "").split(",") if u]
    return response.json()["choices"][0]["message"]["content"], served


def _reload(scaler: Any, file: str, interrupted: Any) -> None:
    """Re-reads the manifest and scales the fleet to it; a bad edit is reported, not fatal."""
    import yaml

    try:
        manifest = yaml.safe_load(Path(file).read_text())
        lines = scaler.reload(manifest, interrupted)
    except (OSError, ValueError, yaml.YAMLError, RuntimeError, TimeoutError) as exc:
        print(f"kvpilot up: reload of {file} refused: {exc}", file=sys.stderr, flush=True)
        return
    for line in lines or ["no replica count changed"]:
        print(f"kvpilot up: reloaded {file}: {line}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """Runs the fleet until Ctrl-C/SIGTERM (or one request with --once); gives the exit code.

    SIGHUP re-reads the manifest and scales its pools to the new replica counts.
    """
    import yaml

    from kvpilot.operator.local.plan import plan_local
    from kvpilot.operator.local.scaler import Scaler
    from kvpilot.operator.local.supervisor import Supervisor, free_port

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvpilot-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    instances_file = log_dir / "router-instances"
    secret_file = write_fleet_secret()
    try:
        manifest: dict[str, Any] = yaml.safe_load(Path(args.file).read_text())
        engines, router = plan_local(manifest, free_port, args.port,
                                     instances_file=str(instances_file),
                                     fleet_secret_file=str(secret_file),
                                     model_dir=args.model_dir)
        check_api_key(manifest)
        if args.model_dir is not None and not Path(args.model_dir).is_dir():
            raise ValueError(f"--model-dir {args.model_dir} is not a directory: pass the "
                             "--local-dir that kvpilot fetch downloaded the weights to")
    except (OSError, ValueError, yaml.YAMLError) as exc:
        secret_file.unlink()
        print(f"kvpilot up: {args.file}: {exc}", file=sys.stderr)
        return 2
    try:  # before any engine starts: a router that cannot bind would restart forever
        socket.create_server(("127.0.0.1", args.port)).close()
    except OSError as exc:
        secret_file.unlink()
        print(f"kvpilot up: cannot listen on 127.0.0.1:{args.port} ({exc.strerror or exc}): "
              "pass --port N or stop the process that holds it", file=sys.stderr)
        return 2
    model = manifest["spec"]["model"]["name"]
    supervisor = Supervisor(log_dir)
    scaler = Scaler(supervisor, manifest, router, instances_file, args.timeout,
                    args.drain_timeout, str(secret_file), args.model_dir)
    stop, reload = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: reload.set())
    try:
        print(f"kvpilot up: pid {os.getpid()}; starting {len(engines)} engine(s) and a router; "
              f"logs in {log_dir}", file=sys.stderr, flush=True)
        for process in engines:
            supervisor.start(process)
        scaler.publish()
        supervisor.start(router)
        supervisor.wait_ready(args.timeout, {"router": "/ready"}, stop.is_set)
        endpoint = f"{router.url}/v1"
        if args.once:
            print(f"kvpilot up: serving {model} at {endpoint}; POST /chat/completions "
                  f"{ONCE_PROMPT!r}", file=sys.stderr, flush=True)
            answer, served = _once(router.url, model)
            names = {e.url: e.name for e in supervisor.engines()}
            print(f"kvpilot up: served by {', '.join(names.get(u, u) for u in served)}",
                  file=sys.stderr, flush=True)
            print(answer, flush=True)
            return 0
        print(f"kvpilot up: serving {model} at {endpoint} (Ctrl-C stops)", flush=True)
        print(f"  try: curl {endpoint}/chat/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", "
              f"\"content\": \"hi\"}}]}}'", flush=True)
        print(scale_hint(args.file, os.getpid()), flush=True)
        while not stop.wait(0.5):
            if reload.is_set():
                reload.clear()
                _reload(scaler, args.file, stop.is_set)
            for line in supervisor.tend():  # a dead replica restarts, as a Deployment's would
                print(f"kvpilot up: {line}", file=sys.stderr, flush=True)
        return 0
    except InterruptedError:
        return 130
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"kvpilot up: {exc}", file=sys.stderr)
        return 1
    finally:
        supervisor.stop()
        secret_file.unlink(missing_ok=True)
