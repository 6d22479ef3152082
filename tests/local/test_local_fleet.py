"""A disaggregated fleet from the tiny manifest, run exactly as `kvpilot up` runs it:
greedy answers equal the aggregated engine's, and a decode process killed mid-stream
costs one error event, not a hang or leaked blocks."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from helpers import sse

from kvpilot.engine.contracts.fleet_secret import FleetSecret
from kvpilot.engine.contracts.kv_client import request_stats
from kvpilot.engine.contracts.kv_protocol import kv_address
from kvpilot.engine.engine_loop.roles import LEASE_SECONDS_ENV
from kvpilot.operator.local.cli import write_fleet_secret
from kvpilot.operator.local.plan import plan_local
from kvpilot.operator.local.supervisor import Supervisor, free_port

ROOT = Path(__file__).parents[2]
TINY = yaml.safe_load((ROOT / "examples" / "tiny-cpu.yaml").read_text())
SYSTEM = list(range(10, 74))  # 4 full blocks of 16 tokens shared by the prompts below
PROMPTS = [[*SYSTEM, *range(100, 120)], [*SYSTEM, *range(200, 220)], list(range(300, 335))]
CHAT = [{"role": "system", "content": "You are a terse assistant. " * 12},
        {"role": "user", "content": "Name three rivers."}]
LEASE_SECONDS = 2


@pytest.fixture(scope="module")
def disagg_fleet(tmp_path_factory):
    manifest = copy.deepcopy(TINY)
    manifest["spec"].update(servingMode="disaggregated", prefill={"replicas": 1},
                            decode={"replicas": 2})
    secret = write_fleet_secret()  # as kvpilot up does: a prefill/decode engine needs one
    engines, router = plan_local(manifest, free_port, free_port(),
                                 fleet_secret_file=str(secret))
    supervisor = Supervisor(tmp_path_factory.mktemp("fleet-logs"))
    for process in engines:
        process.env[LEASE_SECONDS_ENV] = str(LEASE_SECONDS)
    try:
        for process in [*engines, router]:
            supervisor.start(process)
        supervisor.wait_ready(120, {"router": "/ready"})
        yield supervisor, engines, router, FleetSecret.from_file(str(secret))
    finally:
        supervisor.stop()
        secret.unlink()


@pytest.fixture(scope="module")
def aggregated():
    """Gives a function: the completions of PROMPTS and CHAT from one in-process aggregated
    engine under the given sampling fields."""
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    engine = TINY["spec"]["engine"]
    llm = LLM(model="tiny-llama", dtype=engine["dtype"], max_model_len=engine["maxModelLen"],
              kv_cache_memory=engine["kvCacheMemory"])
    # The chat prompt as the server builds it: template text, encoded without extra BOS.
    tokenizer = llm.engine.tokenizer
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True),
                                add_special_tokens=False)

    def texts(**fields) -> list[str]:
        outputs = llm.generate([*PROMPTS, chat_ids], [SamplingParams(**fields)
                                                      for _ in range(len(PROMPTS) + 1)])
        return [o.outputs[0].text for o in outputs]
    return texts


@pytest.fixture(scope="module")
def aggregated_tokens(aggregated):
    """Gives the greedy completions of PROMPTS (then CHAT) from the aggregated engine."""
    return aggregated(temperature=0, max_tokens=12, ignore_eos=True)


def comparable(text: str) -> str:
    """Gives the text without a trailing U+FFFD: the offline engine ends a cut multi-byte
    character with one, the server drops it (a detokeniser detail, not a KV one)."""
    return text.rstrip("\ufffd")


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_disaggregated_answers_equal_the_aggregated_engine(disagg_fleet, aggregated_tokens):
    _, _, router, _ = disagg_fleet
    with httpx.Client(base_url=router.url, timeout=60) as client:
        texts, transferred = [], []
        for prompt in PROMPTS:
            before = metric(client.get("/metrics").text, "kvpilot_router_transferred_blocks")
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12,
                    "temperature": 0, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
            after = metric(client.get("/metrics").text, "kvpilot_router_transferred_blocks")
            transferred.append(after - before)
        chat = client.post("/v1/chat/completions", json={
            "model": "tiny-llama", "messages": CHAT, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        assert chat.status_code == 200, chat.text
        texts.append(chat.json()["choices"][0]["message"]["content"])
    assert [comparable(t) for t in texts] == [comparable(t) for t in aggregated_tokens]
    # Each transfer also carries the prompt's partial last block (the prefill engine caches it
    # under its tail hash), so the decode engine computes only the last prompt token. Prompt 2
    # shares 4 blocks with prompt 1, which the prefix-aware router sent to the decode instance
    # holding them: only its 5th full block and its tail move.
    assert transferred[:3] == [6, 2, 3]


def streamed(client: httpx.Client, path: str, body: dict) -> tuple[str, set[str]]:
    """Gives a streamed answer's text and the ids its chunks carry."""
    texts, ids = [], set()
    with client.stream("POST", path, json={**body, "stream": True}) as stream:
        assert stream.status_code == 200, stream.read()
        for line in sse.iter_lines(stream):
            if line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, chunk
                ids.add(chunk["id"])
                for c in chunk["choices"]:
                    texts.append((c["delta"].get("content") or "") if "delta" in c else c["text"])
    return "".join(texts), ids


@pytest.mark.parametrize("fields", [
    dict(temperature=0),
    dict(temperature=0.9, seed=7),  # the prefill's draw, then the decode's draws after it
])
def test_streams_take_the_first_token_from_the_prefill(disagg_fleet, aggregated, fields):
    """A streamed request's first token comes from the prefill instance; the decode instance
    continues from it: the text equals the aggregated engine's, one id throughout."""
    _, _, router, _ = disagg_fleet
    sampling = {**fields, "max_tokens": 12, "ignore_eos": True}
    expected = aggregated(**sampling)
    with httpx.Client(base_url=router.url, timeout=60) as client:
        first = "kvpilot_router_requests_total"
        before = metric(client.get("/metrics").text, first, outcome="first_token_from_prefill")
        answers = [streamed(client, "/v1/completions", {"model": "tiny-llama", "prompt": p,
                                                         **sampling}) for p in PROMPTS]
        answers.append(streamed(client, "/v1/chat/completions",
                                {"model": "tiny-llama", "messages": CHAT, **sampling}))
        after = metric(client.get("/metrics").text, first, outcome="first_token_from_prefill")
    assert [comparable(text) for text, _ in answers] == [comparable(t) for t in expected]
    assert all(len(ids) == 1 for _, ids in answers), answers
    assert after - before == len(PROMPTS) + 1


def test_killed_decode_mid_stream(disagg_fleet):
    supervisor, engines, router, fleet = disagg_fleet
    prefill = next(e for e in engines if e.role == "prefill")
    body = {"model": "tiny-llama", "prompt": list(range(400, 430)), "max_tokens": 450,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=router.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            victim_url = stream.headers["x-kvpilot-served-by"].split(",")[-1]
            lines = sse.iter_lines(stream)
            # the first event is the prefill's token; the third is the decode's streaming
            events = (line for line in lines if line)
            for _ in range(3):
                assert next(events).startswith("data: {")
            victim = next(p for p, popen in supervisor.running if p.url == victim_url)
            popen = next(popen for p, popen in supervisor.running if p is victim)
            os.kill(popen.pid, signal.SIGKILL)
            after = [line for line in lines if line]
        # the stream carries on on the surviving decode instance (the router's migration,
        # decision 0130): no error event, and it ends as a whole stream does
        assert after and after[-1] == "data: [DONE]", after[-3:]
        assert not any('"error"' in line for line in after), [line for line in after if "error" in line]
        for _ in range(3):  # later requests go to the surviving decode instance
            response = client.post("/v1/completions", json={**body, "stream": False,
                                                            "max_tokens": 4})
            assert response.status_code == 200, response.text
            assert response.headers["x-kvpilot-served-by"].split(",")[-1] != victim_url
        metrics = client.get("/metrics").text
        assert metric(metrics, "kvpilot_router_ejections_total", instance=victim_url) == 1, [
            line for line in metrics.splitlines() if "requests_total{" in line or "eject" in line]
    # The pull to the dead decode failed, so one lease was left open; once it expires the
    # prefill engine owns no block. (Its /metrics only refresh after a step, so ask its agent.)
    agent = kv_address(prefill.url)
    deadline = time.monotonic() + LEASE_SECONDS + 3
    stats = asyncio.run(request_stats(agent, key=fleet.kv_key))
    while stats["owned_blocks"] and time.monotonic() < deadline:
        time.sleep(0.2)
        stats = asyncio.run(request_stats(agent, key=fleet.kv_key))
    assert stats == {"leases": 0, "leased_blocks": 0, "owned_blocks": 0}


def test_kvpilot_up_once_answers_and_leaves_nothing_running(tmp_path):
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli.main", "up", "--once", "--port", str(port),
         "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    for log in tmp_path.glob("*.log"):  # every process shut down through its drain path
        assert "Finished server process" in log.read_text(), log.name


def test_kvpilot_up_once_runs_the_tiny_disaggregated_example(tmp_path):
    """The example's prefill and decode engines each need the fleet secret kvpilot up
    generates (they refuse to start without one); the answer crosses both."""
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli.main", "up", "examples/tiny-disagg-cpu.yaml",
         "--once", "--port", str(port), "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "kvpilot up: served by tiny-pd-prefill-0, tiny-pd-decode-0" in result.stderr
    assert sorted(log.name for log in tmp_path.glob("*.log")) == [
        "tiny-pd-decode-0.log", "tiny-pd-prefill-0.log", "tiny-pd-router.log"]


def test_kvpilot_up_refuses_a_hub_source_up_front_with_the_fetch_command(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli.main", "up", "examples/disaggregated.yaml",
         "--port", str(free_port()), "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith(
        "kvpilot up: examples/disaggregated.yaml: spec.model.source='hf://Qwen/Qwen3-8B': ")
    assert "`kvpilot fetch Qwen/Qwen3-8B --local-dir DIR`" in result.stderr
    assert "add --model-dir DIR" in result.stderr
    assert not list(tmp_path.glob("*.log"))  # nothing started


def test_kvpilot_up_on_a_busy_port_is_one_line_exit_2(tmp_path):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvpilot.cli.main", "up", "--port", str(port),
             "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.glob("*.log"))  # nothing started


def test_kvpilot_up_stops_everything_on_sigterm(tmp_path):
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "kvpilot.cli.main", "up", "--port", str(port),
         "--log-dir", str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = up.stdout.readline()  # printed once the fleet is ready
        assert f"http://127.0.0.1:{port}/v1" in line, line
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": "hello", "max_tokens": 2})
        assert response.status_code == 200
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
    finally:
        up.kill()
    logs = list(tmp_path.glob("*.log"))
    assert len(logs) == 2
    for log in logs:
        assert "Finished server process" in log.read_text(), log.name
