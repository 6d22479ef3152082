"""The router polls each engine's GET /kv_events and applies them to its prefix index."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from router_fake_engine import FakeEngine, serving

from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.router.app import build_app

BLOCK = 4
PROMPT = "abcdefghijklmnop"  # 4 full blocks of 4 "tokens"


class CharTokenizer:
    """One token per character: enough for the router to hash prompts as engines do."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


HASHES = hash_prompt_blocks([ord(c) for c in PROMPT], BLOCK)


async def until(condition, seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting"
        await asyncio.sleep(0.02)


async def test_a_removed_event_stops_the_prefix_aware_policy_scoring_that_instance():
    a, b = FakeEngine("a"), FakeEngine("b")
    async with contextlib.AsyncExitStack() as stack:
        url_a = await stack.enter_async_context(serving(a.app()))
        url_b = await stack.enter_async_context(serving(b.app()))
        args = RouterArgs(instances=f"both={url_a},both={url_b}", policy="prefix-aware",
                          block_size=BLOCK, refresh_interval=0.05)
        app = build_app(args, tokenizer=CharTokenizer())
        router_url = await stack.enter_async_context(serving(app))
        index = app.state.router.index
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=router_url))

        async def send() -> str:
            answer = await client.post("/v1/completions", json={"model": "tiny",
                                                                "prompt": PROMPT})
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["text"]

        # a caches the whole prompt; b caches its first two blocks: a wins on prefix
        for block_hash in HASHES:
            a.kv_events.stored(block_hash)
        for block_hash in HASHES[:2]:
            b.kv_events.stored(block_hash)
        await until(lambda: index.match(url_a, HASHES) == 4 and index.match(url_b, HASHES) == 2)
        assert await send() == "a"

        # a evicts the prompt's blocks: the router forgets them, so b's partial hit wins
        for block_hash in HASHES:
            a.kv_events.removed(block_hash)
        await until(lambda: index.match(url_a, HASHES) == 0)
        assert index.size(url_a) == 0
        assert await send() == "b"

        # a cleared its cache after storing again: the instance's entries reset
        a.kv_events.stored(HASHES[0])
        await until(lambda: index.size(url_a) == 1)
        a.kv_events.cleared()
        await until(lambda: index.size(url_a) == 0)


async def test_without_a_tokenizer_the_router_does_not_poll_kv_events():
    a = FakeEngine("a")
    a.kv_events.stored(HASHES[0])
    async with contextlib.AsyncExitStack() as stack:
        url_a = await stack.enter_async_context(serving(a.app()))
        app = build_app(RouterArgs(instances=f"both={url_a}", block_size=BLOCK,
                                   refresh_interval=0.05))
        await stack.enter_async_context(serving(app))
        router = app.state.router
        await until(lambda: router.fleet.instances[url_a].ready)
        await asyncio.sleep(0.2)  # a few refreshes
        assert router.index.size(url_a) == 0
