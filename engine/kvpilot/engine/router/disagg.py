"""Disaggregated serving: a prefill instance computes the prompt's KV, a decode instance
pulls it and streams the answer.

1. router -> prefill (HTTP): the request with `max_tokens: 1`, `stream: false`.
   The prefill engine runs the prompt and, when it finishes, pins the prompt's
   KV blocks under a lease named by the response's `id` (engine/roles.py).
2. router -> decode's KV agent (TCP, kv_transfer/protocol.py): PULL that lease
   from the prefill's agent. The decode agent fetches only the blocks its
   prefix cache lacks, imports them, and releases the lease.
3. router -> decode (HTTP): the original request. Its prompt now hits the
   decode engine's prefix cache, the partial last block included (a prefill engine
   caches it under its tail hash); only the prompt's last token is computed, and
   the answer streams back through the router.

Nothing here is fatal to the request: a prefill that fails on every tried
instance, or a transfer that fails, leaves the decode instance to prefill
locally (counted as `prefill_fallback` / `transfer_fallback`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from kvpilot.engine.router.fleet import Instance
from kvpilot.engine.router.proxy import RETRY_STATUSES, NoInstance
from kvpilot.engine.router.stall import Stalled, until_stalled

log = logging.getLogger("kvpilot.router")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """Gives the body sent to the prefill instance: one token, one choice, no stream."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    out.update({"max_tokens": 1, "stream": False, "n": 1})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def disaggregatable(body: dict[str, Any]) -> bool:
    """Whether one prefill can serve the body (a single prompt; batches prefill locally)."""
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))


async def run_prefill(client: httpx.AsyncClient, pick: Callable[[set[str]], Awaitable[Instance]],
                      path: str, body: dict[str, Any], headers: dict[str, str],
                      attempts: int, on_result: Callable[..., None],
                      ) -> tuple[Instance | None, str | None]:
    """Gives (prefill instance, lease id); the id is None when no prefill succeeded."""
    tried: set[str] = set()
    request = prefill_body(body)
    for _ in range(attempts):
        try:
            instance = await pick(tried)
        except NoInstance:
            break
        tried.add(instance.url)
        try:
            response = await until_stalled(instance.stall, client.post(
                instance.url + path, json=request, headers=headers))
        except Stalled:
            log.info("prefill on %s: the instance stalled", instance.url)
            continue  # ejected already
        except (httpx.HTTPError, OSError) as exc:
            log.info("prefill on %s failed: %r", instance.url, exc)
            on_result(instance, False, isinstance(exc, httpx.ConnectError))
            continue
        if response.status_code in RETRY_STATUSES:
            on_result(instance, response.status_code == 429)  # busy is not broken
            continue
        on_result(instance, True)
        if response.status_code >= 400:
            return instance, None  # a bad request: the decode instance tells the client
        try:
            lease_id = response.json().get("id")
        except ValueError:
            lease_id = None
        return instance, lease_id if isinstance(lease_id, str) else None
    return None, None
