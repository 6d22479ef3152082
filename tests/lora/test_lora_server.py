"""LoRA through the OpenAI server and the engine core process: `model` selects the adapter,
/v1/models lists adapters under their parent, run-time load/unload behind the API key loses
no request, and /metrics carries vLLM's lora_requests_info gauge."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import sse
from helpers.lora_adapters import hf_greedy
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.contracts.outputs import EngineStats
from kvpilot.engine.contracts.tokenizer import load_tokenizer
from kvpilot.engine.server.app import build_app
from kvpilot.engine.server.metrics import ServerMetrics
from tests.server.server_harness import engine_core, serve_in_thread

KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(base_dir, adapters):
    with engine_core(model=str(base_dir), enable_lora=True, max_loras=1,
                     lora_modules=[f"attn={adapters['attn']}"]) as core:
        app = build_app(core.handle, load_tokenizer(str(base_dir)), str(base_dir),
                        auth=HttpAuth(KEY))
        with serve_in_thread(app) as running:
            yield running


def _complete(base_url: str, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", headers=AUTH, timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True})


def test_models_lists_adapters_under_their_parent(served, base_dir, adapters):
    assert httpx.get(f"{served.base_url}/v1/models", timeout=10).status_code == 401
    cards = httpx.get(f"{served.base_url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(str(base_dir), None),
                                                      ("attn", str(base_dir))]
    assert cards[1]["root"] == str(adapters["attn"])


def test_model_field_selects_the_adapter(served, base_dir, adapters):
    prompt = [random.Random(4).randrange(5, 1000) for _ in range(12)]
    tokenizer = load_tokenizer(str(base_dir))
    for model, adapter in ((str(base_dir), None), ("attn", adapters["attn"])):
        answer = _complete(served.base_url, model, prompt)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == model  # the adapter's name, as vLLM answers
        assert answer.json()["choices"][0]["text"] == tokenizer.decode(
            hf_greedy(base_dir, adapter, prompt, 8))


def test_unknown_model_is_refused_naming_model(served):
    answer = _complete(served.base_url, "nope", [5, 6, 7])
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "model" and "model='nope' is not a loaded LoRA adapter" in \
        error["message"]


def test_load_and_unload_under_load_lose_no_request(served, adapters):
    url = served.base_url
    assert httpx.post(f"{url}/v1/load_lora_adapter", timeout=60, json={
        "lora_name": "mlp", "lora_path": str(adapters["mlp"])}).status_code == 401
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, timeout=60, json={
        "lora_name": "mlp", "lora_path": str(adapters["mlp"])})
    assert loaded.status_code == 200, loaded.text
    again = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, timeout=60, json={
        "lora_name": "mlp", "lora_path": str(adapters["mlp"])})
    assert again.status_code == 400 and "already loaded" in again.text
    models = ["attn", "mlp", "attn", "mlp", served_base(url), "mlp"] * 2
    unloads: list[int] = []
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_complete, url, m, [7 + i, 8, 9, 10]) for i, m in
                   enumerate(models)]
        for _ in range(20):  # bounded: unload attempts while mlp requests are in flight
            if all(f.done() for f in futures):
                break
            unloads.append(httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH,
                                      timeout=60, json={"lora_name": "mlp"}).status_code)
            if unloads[-1] == 200:
                break
        answers = [f.result() for f in futures]
    for model, answer in zip(models, answers, strict=True):
        if answer.status_code != 200:  # only a request sent after mlp was unloaded
            assert model == "mlp" and 200 in unloads and answer.status_code == 400, answer.text
            continue
        assert answer.json()["choices"][0]["finish_reason"] == "length"
    assert 400 in unloads or 200 in unloads
    if 200 not in unloads:
        final = httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, timeout=60,
                           json={"lora_name": "mlp"})
        assert final.status_code == 200, final.text
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, timeout=60,
                      json={"lora_name": "mlp"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"
    assert _complete(url, "mlp", [5, 6]).status_code == 400


def served_base(url: str) -> str:
    return httpx.get(f"{url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]


def test_lora_info_gauge_on_metrics(served):
    samples = [s for f in text_string_to_metric_families(
        httpx.get(f"{served.base_url}/metrics", timeout=10).text) for s in f.samples
        if s.name == "vllm:lora_requests_info"]
    assert len(samples) == 1 and samples[0].labels["max_lora"] == "1"


def test_lora_info_gauge_labels():
    metrics = ServerMetrics("m")
    metrics.set_stats(EngineStats(max_lora=4, running_lora_adapters=["a", "b"],
                                  waiting_lora_adapters=["c"]))
    samples = [s for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples if s.name == "vllm:lora_requests_info"]
    assert [s.labels for s in samples] == [{"running_lora_adapters": "a,b",
                                            "waiting_lora_adapters": "c", "max_lora": "4"}]
    assert samples[0].value > 1.7e9  # a Unix time, as vLLM sets it
    metrics.set_stats(EngineStats())  # LoRA off: no gauge
    assert b"lora_requests_info" not in metrics.render()


def test_streamed_chat_with_an_adapter(served):
    body = {"model": "attn", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.base_url}/v1/chat/completions", headers=AUTH,
                      json=body, timeout=120) as answer:
        assert answer.status_code == 200
        lines = [ln for ln in sse.iter_lines(answer) if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    assert chunks and all(c["model"] == "attn" for c in chunks)
