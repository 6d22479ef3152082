"""LoRA adapter affinity: the gauge parsed, the candidate rule as a table, and the router end to
end against fake engines that export vLLM's `vllm:lora_requests_info`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import uvicorn
from router_fake_engine import FakeEngine, serving, stop_all
from test_router_app import COMPLETION, served_by

from kvpilot.engine.contracts.lora import lora_root_hash
from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.router.app import Router, build_app
from kvpilot.engine.router.lora import LoraState, lora_candidates, parse_lora, served_adapters
from kvpilot.engine.router.policy import InstanceView

A, B, C = "http://a", "http://b", "http://c"


def lora(running: str = "", waiting: str = "", max_lora: int = 2) -> LoraState:
    return LoraState(frozenset(filter(None, running.split(","))),
                     frozenset(filter(None, waiting.split(","))), max_lora)


@pytest.mark.parametrize(("text", "expected"), [
    ('vllm:lora_requests_info{running_lora_adapters="sql,law",waiting_lora_adapters="med",'
     'max_lora="4"} 1.7e9\n', lora("sql,law", "med", 4)),
    # vLLM keeps every label set it ever set; the newest (largest time) is the current one
    ('vllm:lora_requests_info{running_lora_adapters="old",waiting_lora_adapters="",'
     'max_lora="2"} 100.0\n'
     'vllm:lora_requests_info{running_lora_adapters="",waiting_lora_adapters="new",'
     'max_lora="2"} 200.0\n', lora("", "new", 2)),
    ('vllm:lora_requests_info{running_lora_adapters="",waiting_lora_adapters="",'
     'max_lora="1"} 5.0\n', lora(max_lora=1)),
    ('vllm:num_requests_waiting{model_name="tiny"} 3.0\n', None),  # LoRA off
])
def test_parse_lora(text: str, expected: LoraState | None):
    assert parse_lora(text) == expected


def test_served_adapters_are_the_cards_with_a_parent():
    models = {"data": [{"id": "tiny"}, {"id": "sql", "parent": "tiny"}, {"id": "x", "parent": None},
                       "junk", {"parent": "tiny"}]}
    assert served_adapters(models) == {"sql"}
    assert served_adapters(["not", "a", "dict"]) == frozenset()


V = InstanceView
MARGIN = 4.0


@pytest.mark.parametrize(("views", "states", "expected", "outcome"), [
    # holders only, however busy the holder is among holders
    ([V(A, 3), V(B, 0), V(C, 0)], {A: lora("sql"), B: lora("law"), C: lora("med")}, [A],
     "affinity"),
    ([V(A, 3), V(B, 1)], {A: lora("sql"), B: lora("", "sql")}, [A, B], "affinity"),
    # a holder busier than the best other by exactly the margin still wins ...
    ([V(A, 4), V(B, 0)], {A: lora("sql"), B: lora()}, [A], "affinity"),
    # ... by more, the others with a free slot take it
    ([V(A, 5), V(B, 0), V(C, 0)], {A: lora("sql"), B: lora("x,y"), C: lora("x")}, [C],
     "overloaded"),
    # overloaded and no other has a free slot: any other replica
    ([V(A, 9), V(B, 0), V(C, 1)], {A: lora("sql"), B: lora("x,y"), C: lora("x,z")}, [B, C],
     "overloaded"),
    # no holder: the replicas with a free slot, else all
    ([V(A, 0), V(B, 2)], {A: lora("x,y"), B: lora("x")}, [B], "no_holder"),
    ([V(A, 0), V(B, 2)], {A: lora("x,y"), B: lora("x,z")}, [A, B], "no_holder"),
    # a replica without LoRA (no gauge) neither holds nor has a slot
    ([V(A, 0), V(B, 0)], {A: None, B: lora()}, [B], "no_holder"),
    # every replica holds it: nobody to compare with, so the holders
    ([V(A, 50), V(B, 40)], {A: lora("sql"), B: lora("sql")}, [A, B], "affinity"),
], ids=["one-holder", "running-or-waiting", "at-margin", "over-margin", "over-margin-all-full",
        "no-holder-free-slot", "no-holder-all-full", "lora-off-replica", "all-hold"])
def test_candidates(views: list[InstanceView], states: dict[str, LoraState | None],
                    expected: list[str], outcome: str):
    chosen, why = lora_candidates(views, states, "sql", MARGIN)
    assert ([v.url for v in chosen], why) == (expected, outcome)


async def until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    """Waits (bounded) until the router's scrapes show what the test set up."""
    deadline = asyncio.get_running_loop().time() + limit
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not within {limit}s: {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
async def lora_fleet() -> AsyncIterator[tuple[Router, str, dict[str, str], list[FakeEngine]]]:
    """Gives (router state, router URL, {name: engine URL}, engines): three LoRA replicas,
    least-load among candidates, margin 3."""
    engines = [FakeEngine("holder", max_lora=2, running_loras=["sql"], adapters=["sql", "law"]),
               FakeEngine("free", max_lora=2, running_loras=["med"], adapters=["sql", "med", "fin"]),
               FakeEngine("full", max_lora=1, running_loras=["law"], adapters=["sql", "law"])]
    servers: list[uvicorn.Server] = []
    async with contextlib.AsyncExitStack() as stack:
        urls = {e.name: await stack.enter_async_context(serving(e.app(), servers))
                for e in engines}
        app = build_app(RouterArgs(instances=",".join(urls.values()), policy="least-load",
                                   refresh_interval=0.05, lora_affinity_margin=3))
        router_url = await stack.enter_async_context(serving(app, servers))
        router: Router = app.state.router
        await until(lambda: len(router.fleet.available(("both",))) == 3 and all(
            i.lora is not None and i.adapters for i in router.fleet.instances.values()),
            "every replica scraped, its gauge and /v1/models read")
        yield router, router_url, urls, engines
        stop_all(servers)  # together, then the stack awaits each


async def send(client: httpx.AsyncClient, model: str, urls: dict[str, str]) -> str:
    body = {**COMPLETION, "model": model, "prompt": "the same long prompt " * 20}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return served_by(response, urls)


async def test_adapter_requests_follow_their_holders_and_spill_when_they_queue(lora_fleet):
    router, router_url, urls, engines = lora_fleet
    holder = engines[0]
    waiting = lambda url, n: lambda: router.fleet.instances[url].waiting == n  # noqa: E731
    async with httpx.AsyncClient(base_url=router_url, timeout=30) as client:
        # affinity: every sql request to the replica running sql, though the others idle too
        assert [await send(client, "sql", urls) for _ in range(6)] == ["holder"] * 6
        # the router chains an adapter request's hashes at the adapter's root, as engines do:
        # the holder is indexed with sql's blocks, and the same prompt for the base model (or
        # another adapter) matches none of them
        body = {**COMPLETION, "model": "sql", "prompt": "the same long prompt " * 20}
        sql_hashes = router.hasher.hashes(body, lora_root_hash("sql"))
        assert sql_hashes and router.index.match(urls["holder"], sql_hashes) == len(sql_hashes)
        assert router.index.match(urls["holder"], router.hasher.hashes(body)) == 0
        assert router.index.match(urls["holder"],
                                  router.hasher.hashes(body, lora_root_hash("law"))) == 0
        # base-model requests are unchanged: least-load rotates over the tied replicas
        assert {await send(client, "tiny", urls) for _ in range(6)} == {"holder", "free", "full"}
        # the holder queues beyond the margin: the other replica with a free slot takes it
        holder.waiting = 10
        await until(waiting(urls["holder"], 10), "the holder's queue scraped")
        assert [await send(client, "sql", urls) for _ in range(4)] == ["free"] * 4
        # within the margin again: back to the holder
        holder.waiting = 3
        await until(waiting(urls["holder"], 3), "the holder's queue scraped")
        assert await send(client, "sql", urls) == "holder"
        # an adapter no replica runs yet (/v1/models lists it): the one replica with a free slot
        holder.running_loras = ["sql", "law"]
        await until(lambda: router.fleet.instances[urls["holder"]].lora == LoraState(
            frozenset({"sql", "law"}), frozenset(), 2), "the holder's gauge scraped")
        assert [await send(client, "fin", urls) for _ in range(3)] == ["free"] * 3
        metrics = (await client.get("/metrics")).text
    for outcome, count in (("affinity", 7), ("overloaded", 4), ("no_holder", 3)):
        assert f'kvpilot_router_lora_requests_total{{outcome="{outcome}"}} {count}.0' in metrics
