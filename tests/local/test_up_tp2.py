"""`kvpilot up` runs the TP=2 and the PP=2 CPU manifests as the pods would (the engine core
starts its worker rank itself, gloo between them) and answers an OpenAI request through the
router with the single-rank engine's tokens."""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from kvpilot.engine.executor.processes import WORKER_MODULE
from kvpilot.operator.local.plan import plan_local
from kvpilot.operator.local.supervisor import Supervisor, free_port

ROOT = Path(__file__).parents[2]
# example manifest -> the engine flag its topology renders
MANIFESTS = {"tiny-cpu-tp2.yaml": "--tensor-parallel-size",
             "tiny-cpu-pp2.yaml": "--pipeline-parallel-size"}
PROMPT = "tensor parallel on a laptop"


@functools.cache
def single_rank_text(dtype: str, max_model_len: int, kv_cache_memory: str) -> str:
    """Gives the single-rank engine's greedy 8 tokens of PROMPT (the manifests share it)."""
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    return LLM("tiny-llama", dtype=dtype, max_model_len=max_model_len,
               kv_cache_memory=kv_cache_memory).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text


@pytest.mark.parametrize("example", list(MANIFESTS))
def test_up_serves_the_parallel_manifest(tmp_path: Path, example: str):
    manifest = yaml.safe_load((ROOT / "examples" / example).read_text())
    engine = manifest["spec"]["engine"]
    engines, router = plan_local(manifest, free_port, free_port())
    assert len(engines) == 1
    flag = MANIFESTS[example]
    assert engines[0].argv[engines[0].argv.index(flag) + 1] == "2"
    supervisor = Supervisor(tmp_path)
    try:
        for process in [*engines, router]:
            supervisor.start(process)
        # while the fleet starts
        want = single_rank_text(engine["dtype"], engine["maxModelLen"], engine["kvCacheMemory"])
        supervisor.wait_ready(180, {"router": "/ready"})
        pid = next(popen.pid for process, popen in supervisor.running
                   if process.role != "router")
        # the worker is a child of the engine core process, itself the server's child
        workers = [c for c in psutil.Process(pid).children(recursive=True)
                   if WORKER_MODULE in " ".join(c.cmdline())]
        assert len(workers) == 1  # the second rank runs
        answer = httpx.post(f"{router.url}/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == want.rstrip("\ufffd")
        chat = httpx.post(f"{router.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4})
        assert chat.status_code == 200, chat.text
    finally:
        supervisor.stop()
