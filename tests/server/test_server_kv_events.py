"""GET /kv_events: the prefix-cache events a request leaves, read incrementally by `since`."""

from __future__ import annotations

import httpx
from server_harness import MODEL, RunningServer

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.block_hash import hash_prompt_blocks


def events(server: RunningServer, since: int) -> dict:
    answer = httpx.get(f"{server.base_url}/kv_events", params={"since": since}, timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_prompt_s_full_blocks_appear_as_stored_events(server: RunningServer) -> None:
    start = events(server, 0)["next"]
    prompt = [777, 778, 779] * 16  # 48 ids no other test sends: three full blocks of 16
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
    assert httpx.post(f"{server.base_url}/v1/completions", json=body,
                      timeout=60).status_code == 200
    answer = events(server, start)
    stored = [h for e in answer["events"] for h in e.get("stored", [])]
    expected = hash_prompt_blocks(prompt, EngineArgs(model=MODEL).block_size)  # the core's (default)
    assert stored[:len(expected)] == expected
    assert answer["next"] >= start + len(expected)
    assert events(server, answer["next"])["events"] == []  # nothing new since
