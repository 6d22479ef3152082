"""Disaggregated serving: a prefill instance computes the prompt's KV, a decode instance
pulls it and streams the answer.

The handoff rides in the OpenAI body as `kv_transfer_params` (vLLM's field name):

1. router -> prefill: the request with `max_tokens: 1`, `stream: false` and
   `kv_transfer_params: {"do_remote_decode": true}`. The prefill engine runs the
   prompt, keeps its KV blocks under a lease and answers with
   `kv_transfer_params: {"do_remote_prefill": true, "remote_host", "remote_port",
   "lease_id", "block_hashes", "lease_seconds"}`.
2. router -> decode: the original request plus those params. The decode engine
   pulls the blocks it does not already hold (by hash), releases the lease, and
   generates; its stream goes back to the client.

A prefill that fails on every tried instance, or answers without params, is not
fatal: the decode instance then prefills locally (counted as `prefill_fallback`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from kvpilot.engine.router.fleet import Instance
from kvpilot.engine.router.proxy import RETRY_STATUSES, NoInstance

log = logging.getLogger("kvpilot.router")

KV_TRANSFER_PARAMS = "kv_transfer_params"


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """Gives the body sent to the prefill instance: one token, no stream, remote decode."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update({"max_tokens": 1, "stream": False, "n": 1,
                KV_TRANSFER_PARAMS: {"do_remote_decode": True}})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """Gives the body sent to the decode instance (the original one plus the handoff)."""
    out = dict(body)
    if params:
        out[KV_TRANSFER_PARAMS] = params
    return out


async def run_prefill(client: httpx.AsyncClient, pick: Callable[[set[str]], Awaitable[Instance]],
                      path: str, body: dict[str, Any], headers: dict[str, str],
                      attempts: int, on_result: Callable[[Instance, bool], None],
                      ) -> tuple[Instance | None, dict[str, Any] | None]:
    """Gives (prefill instance, handoff params); (None, None) when every attempt failed."""
    tried: set[str] = set()
    request = prefill_body(body)
    for _ in range(attempts):
        try:
            instance = await pick(tried)
        except NoInstance:
            break
        tried.add(instance.url)
        try:
            response = await client.post(instance.url + path, json=request, headers=headers)
        except (httpx.HTTPError, OSError) as exc:
            log.info("prefill on %s failed: %r", instance.url, exc)
            on_result(instance, False)
            continue
        if response.status_code in RETRY_STATUSES:
            on_result(instance, response.status_code == 429)
            continue
        on_result(instance, True)
        if response.status_code >= 400:
            # The request itself is bad: the decode instance will say so to the client.
            return instance, None
        try:
            params = response.json().get(KV_TRANSFER_PARAMS)
        except (json.JSONDecodeError, AttributeError):
            params = None
        return instance, params if isinstance(params, dict) else None
    return None, None
