"""Convergence benchmark: N InferenceModels applied to the kmock API emulator at once.

Measures, with the real operator (`kvpilot operator`) in a subprocess against
the emulator in this process over HTTP: seconds from the first apply until
every InferenceModel has `status.observedGeneration == metadata.generation`,
and the operator process's peak RSS. Goals (issue 5): <= 60 s and <= 300 MB
for 1,000 models.

    .venv/bin/python bench/operator_converge.py --models 1000
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import kmock
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "operator"))
from kube_api import ApiServer  # noqa: E402
from operator_harness import IMS, NAMESPACE, crd_manifests, write_kubeconfig  # noqa: E402

GOAL_SECONDS, GOAL_MB = 60.0, 300.0
RESULTS = REPO / "bench" / "results"
POOLS = "kvpilot.dev/v1alpha1/decodepools"
# OPERATOR_PROFILE=FILE runs the operator under cProfile (for finding its hot spots).
PROFILE = ["-m", "cProfile", "-o", os.environ["OPERATOR_PROFILE"]] \
    if os.environ.get("OPERATOR_PROFILE") else []


def manifest(i: int) -> dict[str, Any]:
    """Gives the i-th InferenceModel: a tiny CPU model, aggregated, one decode replica."""
    name = f"m{i:04d}"
    return {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"model": {"name": name, "source": "dummy:tiny-llama"},
                     "accelerator": {"vendor": "cpu"}}}


def converged(api: ApiServer, key: str = IMS) -> int:
    """Gives how many objects of `key` have status for their current generation."""
    return sum(1 for o in api.live(key, NAMESPACE)
               if (o.get("status") or {}).get("observedGeneration")
               == o["metadata"].get("generation"))


async def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Waits for the operator's liveness endpoint; raises if it exits or never answers."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"operator exited with {proc.returncode}")
            try:
                if (await http.get(f"http://127.0.0.1:{port}/healthz")).is_success:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"operator not healthy within {timeout} s")


async def run(models: int, timeout: float) -> dict[str, Any]:
    """Gives the measured numbers for one run."""
    async with ApiServer() as api, kmock.Server(api) as http:
        api.add_core_resources()
        for crd in crd_manifests():
            api.add_crd(crd)
        tmp = Path(tempfile.mkdtemp())
        env = {**os.environ, "KUBECONFIG": str(write_kubeconfig(tmp / "kubeconfig",
                                                                 str(http.url)))}
        port = 18080 + os.getpid() % 1000
        log = open(tmp / "operator.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [sys.executable, *PROFILE, "-m", "kvpilot.cli.main", "operator", "-A", "--dev",
             "--log-level", "warning", "--liveness", str(port)],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        ps = psutil.Process(proc.pid)
        peak = 0
        try:
            print("waiting for the operator", file=sys.stderr, flush=True)
            await wait_healthy(port, proc, 60)
            await asyncio.sleep(1)  # let the watch streams open
            sem = asyncio.Semaphore(32)
            async with httpx.AsyncClient(base_url=str(http.url),
                                         limits=httpx.Limits(max_connections=32)) as client:
                async def apply(i: int) -> None:
                    async with sem:
                        r = await client.post(
                            f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/inferencemodels",
                            json=manifest(i))
                        r.raise_for_status()

                start = time.monotonic()
                applying = asyncio.gather(*(apply(i) for i in range(models)))
                done, ims_at, pools_at = 0, None, None
                while time.monotonic() - start < timeout:
                    peak = max(peak, ps.memory_info().rss)
                    now = time.monotonic() - start
                    done = converged(api)
                    if ims_at is None and done == models:
                        ims_at = now
                    # Pools are counted once the models are done: each scan of the
                    # emulator's objects costs it CPU the run is measuring.
                    if ims_at is not None and converged(api, POOLS) == models:
                        pools_at = now
                    if ims_at is not None and pools_at is not None:
                        break
                    print(f"\r{now:6.1f} s: {done}/{models} converged, "
                          f"RSS {peak / 2**20:.0f} MB", end="", file=sys.stderr, flush=True)
                    await asyncio.sleep(0.5)
                load = os.getloadavg()[0]
                cpu_operator = sum(ps.cpu_times()[:2])
                cpu_emulator = sum(psutil.Process().cpu_times()[:2])
                await applying
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        return {"models": models, "converged": done, "seconds": round(ims_at, 2) if ims_at else None,
                "seconds_pools_too": round(pools_at, 2) if pools_at else None,
                "peak_rss_mb": round(peak / 2**20, 1), "objects": len(api.objects),
                "load_average_1min": round(load, 1),
                "operator_cpu_seconds": round(cpu_operator, 1),
                "emulator_cpu_seconds": round(cpu_emulator, 1),
                "requests": dict(sorted(
                    (f"{action} {plural}", n) for (action, plural), n in api.calls.items())),
                "operator_log_tail": (tmp / "operator.log").read_text()[-2000:]}


def main() -> int:
    """Runs the benchmark, prints and writes the results; exit code 1 if a goal is missed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default="operator_converge")
    args = parser.parse_args()
    result = asyncio.run(run(args.models, args.timeout))
    result.update({
        "date": datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.node()}: {psutil.cpu_count()} CPU cores "
                   f"({platform.processor() or platform.machine()}), shared with other "
                   "work; emulator and operator on the same cores; no GPU",
        "python": platform.python_version(),
        "goal_seconds": GOAL_SECONDS, "goal_peak_rss_mb": GOAL_MB,
    })
    result["meets_goals"] = (result["converged"] == result["models"]
                             and (result["seconds"] or 1e9) <= GOAL_SECONDS
                             and result["peak_rss_mb"] <= GOAL_MB)
    log_tail = result.pop("operator_log_tail")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(
        f"# Operator convergence ({result['date']})\n\n"
        f"Machine: {result['machine']}.\n\n"
        "Seconds run from the first apply until every InferenceModel (then also every pool) "
        "has `status.observedGeneration == metadata.generation`. The emulator (kmock, in "
        "the benchmark process) and the operator (`kvpilot operator`, a subprocess) share "
        "the cores with whatever else runs; the 1-minute load average and the CPU seconds "
        "each side used are given so runs on busier or quieter machines compare.\n\n"
        "| InferenceModels | converged | seconds (goal ≤ 60) | pools too, seconds | "
        "operator peak RSS MB (goal ≤ 300) | operator CPU s | emulator CPU s | load avg |"
        " objects |\n|---|---|---|---|---|---|---|---|---|\n"
        f"| {result['models']} | {result['converged']} | {result['seconds']} | "
        f"{result['seconds_pools_too']} | {result['peak_rss_mb']} | "
        f"{result['operator_cpu_seconds']} | {result['emulator_cpu_seconds']} | "
        f"{result['load_average_1min']} | {result['objects']} |\n\n"
        f"Reproduce: `.venv/bin/python bench/operator_converge.py --models {result['models']}`\n")
    print(json.dumps(result, indent=2))
    if not result["meets_goals"]:
        print("operator log tail:\n" + log_tail, file=sys.stderr)
    return 0 if result["meets_goals"] else 1


if __name__ == "__main__":
    sys.exit(main())
