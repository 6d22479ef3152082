"""The router end to end against fake engines: spreading, retries, ejection, stream errors,
auth, prefix affinity, holding for capacity and the disaggregated handoff."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from helpers import sse
from router_fake_engine import FakeEngine

from kvpilot.engine.contracts import kv_protocol as protocol
from kvpilot.engine.contracts.kv_auth import accept_peer
from kvpilot.engine.contracts.kv_client import NO_SECRET_KEY
from kvpilot.engine.contracts.router_args import INSTANCE_HEADER, SERVED_BY_HEADER, RouterArgs

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


def served_by(response: httpx.Response, urls: dict[str, str]) -> str:
    """Gives the fake engine's name that served the response (last hop)."""
    by_url = {url: name for name, url in urls.items()}
    return by_url[response.headers[SERVED_BY_HEADER].split(",")[-1]]


async def test_round_robin_spreads_over_all_instances(fleet):
    router, urls = await fleet([FakeEngine("a"), FakeEngine("b"), FakeEngine("c")],
                               policy="round-robin")
    async with httpx.AsyncClient(base_url=router) as client:
        names = [served_by(await client.post("/v1/completions", json=COMPLETION), urls)
                 for _ in range(6)]
    assert sorted(names) == ["a", "a", "b", "b", "c", "c"]


async def test_least_load_avoids_the_instance_with_a_queue(fleet):
    router, urls = await fleet([FakeEngine("idle"), FakeEngine("queued", waiting=5)],
                               policy="least-load", refresh_interval=0.05)
    async with httpx.AsyncClient(base_url=router) as client:
        await client.get("/ready")
        await asyncio.sleep(0.3)  # let the scrape see the queue
        names = {served_by(await client.post("/v1/completions", json=COMPLETION), urls)
                 for _ in range(4)}
    assert names == {"idle"}


@pytest.mark.parametrize(("mode", "outcome_retried"), [("fail500", True), ("busy429", True)])
async def test_failure_before_first_byte_is_retried_elsewhere(fleet, mode, outcome_retried):
    router, urls = await fleet([FakeEngine("bad", mode=mode), FakeEngine("good")],
                               policy="round-robin")
    async with httpx.AsyncClient(base_url=router) as client:
        for stream in (False, True):
            for _ in range(2):  # round-robin starts on each instance once
                response = await client.post("/v1/completions",
                                             json={**COMPLETION, "stream": stream})
                assert response.status_code == 200
                assert served_by(response, urls) == "good"
        metrics = (await client.get("/metrics")).text
    assert ("kvpilot_router_retries_total" in metrics) is outcome_retried


async def test_client_error_is_passed_through_not_retried(fleet):
    bad = FakeEngine("bad", mode="bad_request")
    router, _ = await fleet([bad, FakeEngine("other", mode="bad_request")], policy="round-robin")
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 400
    assert "max_tokens" in response.json()["error"]["message"]


async def test_repeated_failures_eject_the_instance(fleet):
    bad = FakeEngine("bad", mode="fail500")
    router, urls = await fleet([bad, FakeEngine("good")], policy="round-robin",
                               eject_after_failures=2, eject_seconds=60)
    async with httpx.AsyncClient(base_url=router) as client:
        for _ in range(6):
            assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert len(bad.bodies) == 2  # after two failures nobody sends it anything
    assert f'kvpilot_router_ejections_total{{instance="{urls["bad"]}"}} 1.0' in metrics


@pytest.mark.parametrize(("modes", "status", "message"), [
    # how many attempts fit depends on when the instances' health checks bring them back (7,
    # and 8 on a loaded machine): the message names the count and the bound
    (("fail500", "fail500"), 502, r"all [78] attempts failed \(--max-retries=5"),
    (("busy429", "busy429"), 429, "every instance is busy"),
    (("busy429", "fail500"), 502, r"all [78] attempts failed \(--max-retries=5"),
])
async def test_all_instances_failing(fleet, modes, status, message):
    # max_retries exceeds the instance count: once each was tried the request holds, each
    # instance coming back at its next health check (`router.tries`), except when all were busy
    router, _ = await fleet([FakeEngine(f"e{i}", mode=m) for i, m in enumerate(modes)],
                            max_retries=5, eject_after_failures=10)
    async with httpx.AsyncClient(base_url=router) as client:
        start = asyncio.get_running_loop().time()
        response = await client.post("/v1/completions", json=COMPLETION)
        assert asyncio.get_running_loop().time() - start < 5
    assert response.status_code == status
    assert re.search(message, response.json()["error"]["message"])


async def test_stream_cut_after_first_byte_ends_with_an_error_event(fleet):
    router, _ = await fleet([FakeEngine("dying", mode="die_after_first")], max_migrations=0)
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    events = [line.removeprefix("data: ") for line in sse.lines(response.text) if line]
    assert json.loads(events[0])["choices"][0]["text"] == "dying:0"
    error = json.loads(events[-1])["error"]
    assert error["code"] == 502 and "not resumed: --max-migrations=0" in error["message"]


async def test_stream_cut_mid_event_drops_the_torn_event_and_ends_with_a_whole_error(fleet):
    router, _ = await fleet([FakeEngine("torn", mode="die_mid_event")], max_migrations=0)
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    events = [line.removeprefix("data: ") for line in sse.lines(response.text) if line]
    # every event parses: the half event is not relayed, the error is an event of its own
    assert [json.loads(e).get("error", {}).get("code") for e in events] == [None, 502]
    assert json.loads(events[0])["choices"][0]["text"] == "torn:0"


@pytest.mark.parametrize(("header", "status"), [
    (None, 401), ("Bearer wrong", 401), ("secret", 401), ("Bearer secret", 200)])
async def test_api_key(fleet, header, status):
    router, _ = await fleet([FakeEngine("a")], api_key="secret")
    headers = {"Authorization": header} if header else {}
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", json=COMPLETION, headers=headers)
        assert response.status_code == status
        assert (await client.get("/health")).status_code == 200  # probes need no key


async def test_prefix_aware_keeps_a_shared_prefix_on_one_instance(fleet):
    router, urls = await fleet([FakeEngine(n) for n in "abcd"], policy="prefix-aware")
    systems = [f"system prompt number {i} " * 40 for i in range(4)]
    async with httpx.AsyncClient(base_url=router) as client:
        chosen: dict[int, set[str]] = {i: set() for i in range(4)}
        for turn in range(3):
            for i, system in enumerate(systems):
                body = {**COMPLETION, "prompt": system + f"user turn {turn}"}
                chosen[i].add(served_by(await client.post("/v1/completions", json=body), urls))
    assert all(len(names) == 1 for names in chosen.values()), chosen
    assert len(set().union(*chosen.values())) == 4  # new prefixes spread by load


async def test_pinned_instance_header(fleet):
    router, urls = await fleet([FakeEngine("a"), FakeEngine("b")], policy="round-robin")
    async with httpx.AsyncClient(base_url=router) as client:
        names = {served_by(await client.post("/v1/completions", json=COMPLETION,
                                             headers={INSTANCE_HEADER: urls["b"]}), urls)
                 for _ in range(3)}
    assert names == {"b"}


async def test_no_instance_holds_then_503(fleet):
    router, _ = await fleet([FakeEngine("p", role="prefill")], hold_timeout=0.3)
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", json=COMPLETION)
        ready = await client.get("/ready")
    assert response.status_code == 503
    assert "hold_timeout=0.3" in response.json()["error"]["message"]
    assert ready.status_code == 503


async def fake_decode_agent(pulls: list[dict]) -> asyncio.Server:
    """Gives a KV agent that records PULL requests and answers DONE."""
    async def handle(reader, writer):
        await accept_peer(reader, writer, NO_SECRET_KEY)
        _, message = await protocol.expect(reader, protocol.Frame.PULL)
        pulls.append(message)
        writer.write(protocol.encode(protocol.Frame.DONE, {"imported": 3, "skipped": 1}))
        await writer.drain()
        writer.close()
    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_disaggregated_prefill_then_pull_then_decode(fleet):
    prefill, decode = FakeEngine("p", role="prefill"), FakeEngine("d", role="decode")
    pulls: list[dict] = []
    agent = await fake_decode_agent(pulls)
    agent_port = agent.sockets[0].getsockname()[1]
    # Every instance's agent sits at its HTTP port + offset; only the decode's matters here.
    def offset_to_agent(urls: dict[str, str]) -> dict[str, int]:
        return {"kv_port_offset": agent_port - int(urls["d"].rsplit(":", 1)[1])}

    router, urls = await fleet([prefill, decode], late=offset_to_agent)
    offset = offset_to_agent(urls)["kv_port_offset"]
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
        metrics = (await client.get("/metrics")).text
    agent.close()
    assert response.status_code == 200
    assert response.headers[SERVED_BY_HEADER] == f"{urls['p']},{urls['d']}"
    assert prefill.bodies[-1]["max_tokens"] == 1 and prefill.bodies[-1]["stream"] is False
    prefill_port = int(urls["p"].rsplit(":", 1)[1])
    assert pulls == [{"remote": f"127.0.0.1:{prefill_port + offset}",
                      "lease_id": f"cmpl-p-{len(prefill.bodies)}", "timeout": 10.0}]
    # the client's body, with the prefill's first token given (`router.disagg.FirstToken`)
    assert decode.bodies[-1] == {**COMPLETION, "stream": True, "first_token_id": 7}
    assert "kvpilot_router_transferred_blocks_total 3.0" in metrics


async def test_failed_transfer_falls_back_to_local_prefill(fleet):
    decode = FakeEngine("d", role="decode")
    router, _ = await fleet([FakeEngine("p", role="prefill"), decode], transfer_timeout=2.0)
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", json=COMPLETION)
        metrics = (await client.get("/metrics")).text
    assert response.status_code == 200 and len(decode.bodies) == 1
    assert 'outcome="transfer_fallback"' in metrics


async def test_failed_prefill_falls_back_to_local_prefill_on_decode(fleet):
    decode = FakeEngine("d", role="decode")
    router, _ = await fleet([FakeEngine("p", role="prefill", mode="fail500"), decode],
                            max_retries=0)
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", json=COMPLETION)
        metrics = (await client.get("/metrics")).text
    assert response.status_code == 200 and len(decode.bodies) == 1
    assert 'outcome="prefill_fallback"' in metrics


@pytest.mark.parametrize(("prompt", "disaggregated"), [
    ("hello", False),  # no full block: under the threshold, prefilled by the decode instance
    ("x" * 2000, True),  # ~30 blocks of 64 bytes: over it, through the prefill instance
])
async def test_a_prompt_under_the_threshold_is_prefilled_by_the_decode_instance(
        fleet, prompt, disaggregated):
    prefill, decode = FakeEngine("p", role="prefill"), FakeEngine("d", role="decode")
    router, _ = await fleet([prefill, decode], disagg_min_prompt_tokens=256,
                            transfer_timeout=2.0)
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", json={**COMPLETION, "prompt": prompt})
        metrics = (await client.get("/metrics")).text
    assert response.status_code == 200 and len(decode.bodies) == 1
    assert len(prefill.bodies) == (1 if disaggregated else 0)
    assert ('outcome="local_prefill"' in metrics) is not disaggregated


def test_a_negative_threshold_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="disagg_min_prompt_tokens=-1 is invalid"):
        RouterArgs(instances="http://127.0.0.1:1", disagg_min_prompt_tokens=-1)


async def test_kv_events_refine_the_index(fleet):
    router, urls = await fleet([FakeEngine("a")])
    async with httpx.AsyncClient(base_url=router) as client:
        stored = await client.post("/kv_events", json={"instance": urls["a"], "stored": [1, 2]})
        removed = await client.post("/kv_events", json={"instance": urls["a"], "removed": [2]})
        unknown = await client.post("/kv_events", json={"instance": "http://x:1", "stored": [5]})
    assert [r.json()["entries"] for r in (stored, removed, unknown)] == [2, 1, 1]


async def test_request_timeout_mid_stream_is_the_clients_budget_not_a_failure(fleet):
    slow = FakeEngine("slow", chunks=20, stream_delay=0.1)
    router, urls = await fleet([slow], request_timeout=0.5, eject_after_failures=1)
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
        events = [line.removeprefix("data: ") for line in sse.lines(response.text) if line]
        metrics = (await client.get("/metrics")).text
        again = await client.post("/v1/completions", json=COMPLETION)
    assert 2 <= len(events) < 20
    assert json.loads(events[-1])["error"]["code"] == 504
    assert f'instance="{urls["slow"]}",outcome="timeout"' in metrics
    assert again.status_code == 200  # not ejected


async def test_request_waits_for_a_starting_instance(fleet):
    starting = FakeEngine("starting", metrics_up=False)
    router, _ = await fleet([starting], hold_timeout=10, refresh_interval=0.05)
    async with httpx.AsyncClient(base_url=router) as client:
        request = asyncio.create_task(client.post("/v1/completions", json=COMPLETION))
        await asyncio.sleep(0.5)
        assert not request.done()
        metrics = (await client.get("/metrics")).text
        assert 'kvpilot_router_pending_requests{role="both"} 1.0' in metrics
        assert 'kvpilot_router_instances{role="both",state="not_ready"} 1.0' in metrics
        starting.metrics_up = True  # the engine finished loading
        response = await asyncio.wait_for(request, 60)
    assert response.status_code == 200 and starting.bodies


@pytest.mark.parametrize("content", [b"[1, 2]", b'"text"', b"null", b"{not json", b"\xff\xfe"])
async def test_a_body_that_is_not_a_json_object_is_a_400_without_forwarding(fleet, content):
    engine = FakeEngine("a")
    router, _ = await fleet([engine])
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/completions", content=content,
                                     headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    # the engine's body (`contracts.openai_errors`), the engine's words: the parity test
    # (tests/server/test_router_parity.py) sends these to both
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None,
                                                              None)
    assert "JSON" in error["message"] or "UTF-8" in error["message"]
    assert engine.bodies == []


@pytest.mark.parametrize("disaggregated", [False, True])
async def test_a_lone_surrogate_or_nan_reaches_the_engines_as_sent(fleet, disaggregated):
    """httpx cannot encode a lone surrogate or NaN: the router answered 500 with a
    traceback (issue 49). Each leg now gets JSON that parses to the client's object, for
    the engine to refuse naming the field."""
    engines = ([FakeEngine("p", role="prefill"), FakeEngine("d", role="decode")]
               if disaggregated else [FakeEngine("a")])
    router, _ = await fleet(engines, transfer_timeout=0.5)
    raw = (b'{"model": "tiny", "stream": true, "temperature": NaN, "stop": ["\\ud800"], '
           b'"messages": [{"role": "user", "content": "a\\ud800b"}]}')
    async with httpx.AsyncClient(base_url=router) as client:
        response = await client.post("/v1/chat/completions", content=raw,
                                     headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text
    for engine in engines:
        body = engine.bodies[-1]
        assert body["messages"][0]["content"] == "a\ud800b" and body["stop"] == ["\ud800"]
        assert body["temperature"] != body["temperature"]  # NaN


async def test_a_body_over_the_limit_is_a_413_unread(fleet):
    engine = FakeEngine("a")
    router, _ = await fleet([engine], max_request_bytes=4096)
    async with httpx.AsyncClient(base_url=router) as client:
        big = await client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 5000})
        small = await client.post("/v1/completions", json=COMPLETION)
    assert big.status_code == 413
    error = big.json()["error"]
    assert "--max-request-bytes" in error["message"] and error["code"] is None
    assert small.status_code == 200 and len(engine.bodies) == 1
