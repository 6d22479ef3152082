"""The conversations behind `previous_response_id`: bounded, per API key, with a TTL.

Each stored response keeps the chat turns up to and including its reply (not its
instructions: OpenAI does not carry them to the next turn), under the tenant of the API key
that made it (a hash of the bearer token; "" without one). A lookup by another key finds
nothing. The store holds at most `--response-store-max-entries` responses, the least
recently used leaving first, each for `--response-store-ttl` seconds.

Router replicas share conversations by asking each other: a router that does not hold an
id asks the routers of `--response-store-peers` (`GET /response_store?id=...&tenant=...`,
signed with the fleet secret like `/kv_events`), so a conversation continues whichever
replica the next turn reaches.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx

from kvpilot.engine.contracts.http_auth import HttpAuth

STORE_PATH = "/response_store"
PEER_TIMEOUT = 2.0  # seconds a peer may take to answer a lookup


def tenant_of(authorization: str | None) -> str:
    """Gives the store's tenant of a request: a hash of its bearer token ("" without one)."""
    if not authorization:
        return ""
    return hashlib.sha256(authorization.encode()).hexdigest()[:32]


@dataclass
class Stored:
    tenant: str
    turns: list[dict[str, Any]]
    expires: float


class ResponseStore:
    """Responses' conversations by id: bounded, expiring, per tenant; peers asked on a miss."""

    def __init__(self, max_entries: int, ttl: float, peers: list[str] | None = None,
                 auth: HttpAuth | None = None) -> None:
        self.max_entries, self.ttl = max_entries, ttl
        self.peers = [p.rstrip("/") for p in peers or []]
        self.auth = auth or HttpAuth()
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, tenant: str, turns: list[dict[str, Any]]) -> None:
        """Keeps a response's conversation, dropping the least recently used beyond the cap."""
        self._entries[response_id] = Stored(tenant, turns, time.monotonic() + self.ttl)
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def local(self, response_id: str, tenant: str) -> list[dict[str, Any]] | None:
        """Gives the conversation held here, None when absent, expired or another tenant's."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry.expires < time.monotonic():
            del self._entries[response_id]
            return None
        if entry.tenant != tenant:
            return None
        self._entries.move_to_end(response_id)
        return entry.turns

    async def get(self, response_id: str, tenant: str, client: httpx.AsyncClient
                  ) -> list[dict[str, Any]] | None:
        """Gives the conversation, from here or from the first peer that holds it."""
        turns = self.local(response_id, tenant)
        if turns is not None or not self.peers:
            return turns
        target = f"{STORE_PATH}?{urlencode({'id': response_id, 'tenant': tenant})}"
        answers = await asyncio.gather(*(self._ask(client, peer, target) for peer in self.peers))
        found = next((a for a in answers if a is not None), None)
        if found is not None:
            self.put(response_id, tenant, found)
        return found

    async def _ask(self, client: httpx.AsyncClient, peer: str, target: str
                   ) -> list[dict[str, Any]] | None:
        try:
            response = await client.get(peer + target, timeout=PEER_TIMEOUT,
                                        headers=self.auth.fleet_headers("GET", target))
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        turns = response.json().get("turns")
        return turns if isinstance(turns, list) else None
