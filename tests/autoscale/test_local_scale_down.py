"""`kvpilot up` scaled by editing its manifest and sending SIGHUP, under steady load.

The real CLI runs as a subprocess; `kvpilot bench serve` drives load through its
router. Scaling the decode pool from 3 replicas to 1 mid-load loses no request
(0 failed in the load generator's report): `kvpilot up` drops the two least
loaded replicas from the router's instances file, waits until the router has
re-read it, then SIGTERMs them and each drains and exits 0. Scaling back up to 2
starts a fresh engine that the router then sends requests to.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml

from kvpilot.engine.contracts.router_args import SERVED_BY_HEADER
from kvpilot.operator.local.supervisor import free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"
KVPILOT = [sys.executable, "-m", "kvpilot.cli.main"]
NUM_PROMPTS = 120


def engine_pids(up: subprocess.Popen) -> list[int]:
    """Gives the pids of the `kvpilot serve` processes `kvpilot up` runs."""
    return [c.pid for c in psutil.Process(up.pid).children()
            if "serve" in c.cmdline() and c.status() != psutil.STATUS_ZOMBIE]


def wait_for(predicate, timeout: float, what: str, up: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert up.poll() is None, f"kvpilot up exited {up.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout}s:\n{log.read_text()}"
        time.sleep(0.2)


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def router_ready_engines(url: str) -> int:
    """Gives how many engines the router itself counts ready (its instances gauge)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    counts = re.findall(r'^kvpilot_router_instances\{[^}]*state="ready"[^}]*\} (\S+)$', text, re.M)
    return sum(int(float(c)) for c in counts)


def scale(manifest_path: Path, manifest: dict, replicas: int, up: subprocess.Popen) -> None:
    manifest["spec"]["decode"]["replicas"] = replicas
    manifest_path.write_text(yaml.safe_dump(manifest))
    up.send_signal(signal.SIGHUP)


def test_up_scales_decode_3_to_1_under_load_losing_nothing_then_back_to_2(tmp_path) -> None:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["decode"]["replicas"] = 3
    path, log, port = tmp_path / "fleet.yaml", tmp_path / "up.log", free_port()
    path.write_text(yaml.safe_dump(manifest))
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        up = subprocess.Popen([*KVPILOT, "up", str(path), "--port", str(port), "--log-dir",
                               str(tmp_path / "logs"), "--timeout", "120"],
                              stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: ready(url), 150, "ready router", up, log)
        assert f"pid {up.pid}" in log.read_text()
        assert len(engine_pids(up)) == 3

        # 3 -> 1 while `kvpilot bench serve` keeps 8 requests/s going through the router.
        report = tmp_path / "bench.json"
        bench = subprocess.Popen([*KVPILOT, "bench", "serve", "--base-url", url, "--model",
                                  manifest["spec"]["model"]["name"], "--num-prompts",
                                  str(NUM_PROMPTS), "--random-input-len", "24",
                                  "--random-output-len", "24", "--request-rate", "8",
                                  "--max-concurrency", "8", "--ignore-eos", "--timeout", "120",
                                  "--result-json", str(report)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        time.sleep(4.0)  # the load generator is up and every replica serves
        # A loaded machine may take longer to drain than the load lasts: what the test needs
        # is requests in flight when the two replicas leave the router.
        assert bench.poll() is None, "the load ended before the scale-down: nothing was tested"
        scale(path, manifest, 1, up)
        scaled_down = re.compile(r"reloaded .*: (\S+): 3 -> 1 replica\(s\); (.*)")
        wait_for(lambda: scaled_down.search(log.read_text()), 60, "scale-down", up, log)
        output, _ = bench.communicate(timeout=120)
        summary = json.loads(report.read_text())
        assert summary["failed"] == 0, (summary["errors"], output.decode())
        assert summary["completed"] == NUM_PROMPTS
        pool, exits = scaled_down.search(log.read_text()).groups()
        assert re.fullmatch(rf"{pool}-\d exited 0, {pool}-\d exited 0", exits), exits
        assert len(engine_pids(up)) == 1

        # 1 -> 2: the new engine starts, joins the router's file, and gets requests.
        body = {"model": manifest["spec"]["model"]["name"], "max_tokens": 2}

        def served_by(i: int) -> str:
            response = httpx.post(f"{url}/v1/completions", timeout=30,
                                  json={**body, "prompt": f"request {i} " * 8})
            assert response.status_code == 200, response.text
            return response.headers[SERVED_BY_HEADER]

        survivor = served_by(0)
        scale(path, manifest, 2, up)
        wait_for(lambda: "1 -> 2 replica(s)" in log.read_text(), 120, "scale-up", up, log)
        assert len(engine_pids(up)) == 2
        # The router re-reads the file and probes the new engine on its own schedule, which a
        # loaded machine stretches: wait for the router to count it ready, then send.
        wait_for(lambda: router_ready_engines(url) == 2, 120, "router with 2 ready engines",
                 up, log)
        # The policy prefers the engine holding fewer cached blocks when no prompt hits:
        # the new one, empty, against the survivor that served the load.
        served = {served_by(i) for i in range(1, 9)}
        assert served - {survivor}, f"the new engine got none of 8 requests: {served}"

        # An edit beyond replica counts is refused by name; the fleet keeps running.
        manifest["spec"]["engine"]["maxNumSeqs"] = 8
        path.write_text(yaml.safe_dump(manifest))
        up.send_signal(signal.SIGHUP)
        wait_for(lambda: "restart for spec.engine.maxNumSeqs" in log.read_text(), 60,
                 "refusal", up, log)
        assert len(engine_pids(up)) == 2
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(30)
    assert code == 0, log.read_text()
