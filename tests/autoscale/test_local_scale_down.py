"""`kvpilot up`'s fleet scaled from 3 decode replicas to 1 under steady load: no request fails.

The two replicas to remove are picked as the operator would order them (least
requests in flight first, from their own /metrics), then SIGTERMed: each engine
drains (finishes what it holds, refuses new work) and exits, and the router
retries refused requests on the replica that stays.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import yaml

from kvpilot.engine.loadgen.datasets import random_dataset
from kvpilot.engine.loadgen.report import summarize
from kvpilot.engine.loadgen.runner import BenchConfig, run_benchmark
from kvpilot.operator.autoscale.pods import removal_order
from kvpilot.operator.autoscale.scrape import scrape
from kvpilot.operator.local.plan import plan_local
from kvpilot.operator.local.supervisor import Supervisor, free_port

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml"


async def test_decode_pool_3_to_1_under_steady_load_loses_nothing(tmp_path) -> None:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["decode"]["replicas"] = 3
    engines, router = plan_local(manifest, free_port, free_port())
    assert len(engines) == 3
    supervisor = Supervisor(tmp_path)
    try:
        for process in [*engines, router]:
            supervisor.start(process)
        await asyncio.to_thread(supervisor.wait_ready, 120, {"router": "/ready"})
        popen = {p.name: proc for p, proc in supervisor.running}
        cfg = BenchConfig(base_url=router.url, model=manifest["spec"]["model"]["name"],
                          request_rate=8.0, max_concurrency=8, ignore_eos=True, timeout=120)
        samples = random_dataset(num_prompts=80, input_len=24, output_len=24,
                                 range_ratio=0.0, seed=1)
        load = asyncio.create_task(run_benchmark(cfg, samples))

        await asyncio.sleep(3.0)  # steady state: every replica has served some requests
        metrics = await scrape({e.name: f"{e.url}/metrics" for e in engines})
        victims = removal_order(metrics)[:2]
        for name in victims:
            popen[name].send_signal(signal.SIGTERM)
        codes = await asyncio.to_thread(
            lambda: [popen[name].wait(60) for name in victims])

        results, duration = await asyncio.wait_for(load, 90)
        report = summarize(results, duration)
        assert report["failed"] == 0, report["errors"]
        assert report["completed"] == len(samples)
        assert codes == [0, 0], [supervisor.log_tail(e) for e in engines if e.name in victims]
        survivor = next(e for e in engines if e.name not in victims)
        assert popen[survivor.name].poll() is None
    finally:
        await asyncio.to_thread(supervisor.stop)
