"""The instances the router knows: roles, scraped load, in-flight counts and health."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from kvpilot.engine.contracts import metric_names as names
from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.contracts.metrics_text import read_metrics
from kvpilot.engine.contracts.repeated_warnings import RepeatedWarnings
from kvpilot.engine.router.discovery import Discovery
from kvpilot.engine.router.health import Health
from kvpilot.engine.router.kv_events import parse_event
from kvpilot.engine.router.lora import LoraState, parse_lora, served_adapters
from kvpilot.engine.router.policy import InstanceView
from kvpilot.engine.router.prefix_index import PrefixIndex
from kvpilot.engine.router.saturation import scraped_slots
from kvpilot.engine.router.stall import find_stalled

log = logging.getLogger("kvpilot.router")

KV_EVENTS_TIMEOUT = 2.0  # seconds; a poll never holds a refresh longer than this
MODELS_TIMEOUT = 2.0  # seconds; the same for a LoRA engine's /v1/models
# A refresh waits this long for its health checks; a slower one (a stalled instance) runs on
# in the background and holds up no other instance's.
PROBE_WAIT = 1.0
PROBE_TIMEOUT = 30.0  # a health check unanswered this long fails (a stall is found sooner)


@dataclass
class Instance:
    """One engine endpoint and what the router knows about it."""

    url: str
    role: str  # both | prefill | decode
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    in_flight: int = 0
    in_flight_at_scrape: int = 0  # `in_flight` when `waiting` was last scraped (flow control)
    max_num_seqs: int = 0  # its scraped kvpilot_max_num_seqs (flow control's slots; 0: unknown)
    # False until its /metrics first answers: a starting engine is not ready, not failing.
    ready: bool = False
    health: Health = field(default_factory=Health)
    kv_events_next: int = 0  # the `since` of the next GET /kv_events
    last_heard: float = 0.0  # monotonic time of its last answer (a byte, a health check)
    waiting_since: float = 0.0  # when the router last began waiting for it from idle
    probe: asyncio.Task[None] | None = None  # the health check (/metrics scrape) running
    stall: asyncio.Event = field(default_factory=asyncio.Event)  # set once found stalled
    lora: LoraState | None = None  # its adapters per vllm:lora_requests_info; None: LoRA off
    adapters: frozenset[str] = frozenset()  # the adapters its /v1/models lists

    def view(self, cached_blocks: int = 0) -> InstanceView:
        return InstanceView(self.url, self.waiting, self.in_flight, self.kv_usage, cached_blocks)

    @property
    def outstanding(self) -> bool:
        """Whether the router waits for something from it (a request or a health check)."""
        return self.in_flight > 0 or (self.probe is not None and not self.probe.done())

    @property
    def silent_since(self) -> float:
        return max(self.last_heard, self.waiting_since)

    @property
    def stalled(self) -> bool:
        return self.health.stalled

    def expect(self) -> None:
        """Notes that the router is about to wait for it (call before sending)."""
        if not self.outstanding:
            self.waiting_since = time.monotonic()


def parse_load(text: str) -> tuple[float, float, float]:
    """Gives (waiting, running, kv_usage) summed over models from Prometheus text."""
    load, _ = read_metrics(text, (names.NUM_REQUESTS_WAITING, names.NUM_REQUESTS_RUNNING,
                                  names.KV_CACHE_USAGE_PERC))
    return (load.get(names.NUM_REQUESTS_WAITING, 0.0), load.get(names.NUM_REQUESTS_RUNNING, 0.0),
            load.get(names.KV_CACHE_USAGE_PERC, 0.0))


class Fleet:
    """Instances by URL, refreshed from discovery and scraped for load."""

    def __init__(self, discovery: Discovery, index: PrefixIndex, *, eject_after: int,
                 eject_seconds: float, auth: HttpAuth | None = None) -> None:
        self.discovery = discovery
        self.index = index
        self.auth = auth or HttpAuth()  # signs the GET /kv_events polls
        self.eject_after, self.eject_seconds = eject_after, eject_seconds
        self.instances: dict[str, Instance] = {}
        self.changed = asyncio.Event()  # set whenever instances appear or come back
        self.on_eject: Callable[[Instance], None] = lambda instance: None
        # Poll engines' GET /kv_events only when the router hashes prompts as the engines do
        # (a tokenizer): otherwise their hashes never match and would only churn the index.
        self.poll_kv_events = False
        # an engine refusing the polls is one line per interval, not one per refresh
        self.kv_events_refusals = RepeatedWarnings(log, "/kv_events refusals")

    def update(self, pairs: list[tuple[str, str]]) -> None:
        """Adds new instances and drops (and forgets the cache of) vanished ones."""
        wanted = {url: role for role, url in pairs}
        for url in list(self.instances):
            if url not in wanted or self.instances[url].role != wanted[url]:
                gone = self.instances.pop(url)
                if gone.probe is not None:
                    gone.probe.cancel()
                self.index.remove_instance(url)
        for url, role in wanted.items():
            if url not in self.instances:
                self.instances[url] = Instance(url, role)
                self.changed.set()

    def available(self, roles: tuple[str, ...], now: float | None = None) -> list[Instance]:
        """Gives the instances of these roles that are not ejected."""
        now = time.monotonic() if now is None else now
        return [i for i in self.instances.values()
                if i.role in roles and i.ready and i.health.available(now)]

    @property
    def all_ready(self) -> bool:
        return all(i.ready for i in self.instances.values())

    def succeeded(self, instance: Instance) -> None:
        instance.health.record_success()

    def failed(self, instance: Instance, reason: str, refused: bool = False) -> bool:
        """Counts a failure of `instance`; gives True when it got ejected.

        A refused connection ejects at once: nothing listens there any more.
        """
        threshold = 1 if refused else self.eject_after
        ejected = instance.health.record_failure(time.monotonic(), threshold, self.eject_seconds)
        if ejected:
            self.on_eject(instance)
            log.warning("ejecting %s for %.0fs after %d failures (last: %s)", instance.url,
                        instance.health.ejected_until - time.monotonic(), threshold, reason)
        return ejected

    def heard(self, instance: Instance) -> None:
        """Notes an answer (bytes) from `instance`; a stalled one is back in rotation."""
        instance.last_heard = time.monotonic()
        if instance.health.stalled:
            instance.health.stalled = False
            instance.stall = asyncio.Event()
            self.changed.set()
            log.warning("%s answers again: back in rotation", instance.url)

    def check_stalls(self, stall_timeout: float) -> list[Instance]:
        """Ejects the instances that now count as stalled (`router.stall`); gives them."""
        found = find_stalled(self.instances.values(), time.monotonic(), stall_timeout)
        for instance in found:
            instance.health.stalled = True
            instance.stall.set()  # its requests still waiting for a first byte move on
            self.on_eject(instance)
            log.warning("%s stalled: nothing from it for %.1fs while others answered; out of "
                        "rotation until it answers a health check", instance.url,
                        time.monotonic() - instance.last_heard)
        return found

    async def refresh(self, client: httpx.AsyncClient) -> None:
        """Re-reads discovery, then health-checks every instance (scrapes its /metrics and KV
        events) concurrently, waiting at most PROBE_WAIT for them."""
        try:
            self.update(await self.discovery.list())
        except (httpx.HTTPError, OSError, ValueError) as exc:
            log.warning("discovery failed, keeping the last instance list: %s", exc)
        started = []
        for instance in list(self.instances.values()):
            if instance.probe is None or instance.probe.done():  # one check at a time each
                instance.expect()
                instance.probe = asyncio.create_task(self._scrape(client, instance))
                started.append(instance.probe)
        if started:
            await asyncio.wait(started, timeout=PROBE_WAIT)
        self.kv_events_refusals.flush()

    def close(self) -> None:
        """Cancels the health checks still running."""
        for instance in self.instances.values():
            if instance.probe is not None:
                instance.probe.cancel()

    async def _scrape(self, client: httpx.AsyncClient, instance: Instance) -> None:
        was_available = instance.health.available(time.monotonic())
        try:
            response = await client.get(f"{instance.url}/metrics", timeout=PROBE_TIMEOUT)
            self.heard(instance)
            response.raise_for_status()
            instance.waiting, instance.running, instance.kv_usage = parse_load(response.text)
            instance.in_flight_at_scrape = instance.in_flight
            instance.max_num_seqs = scraped_slots(response.text)
            instance.lora = parse_lora(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            # Only failures while in rotation count: an ejected instance keeps its backoff,
            # and one that never answered yet is still starting.
            if was_available and instance.ready:
                self.failed(instance, f"/metrics: {exc!r}", isinstance(exc, httpx.ConnectError))
            return
        if not instance.ready:
            instance.ready = True
            self.changed.set()
        if not was_available and instance.health.available(time.monotonic()):
            self.changed.set()
        if instance.lora is not None:
            await self._poll_adapters(client, instance)
        if self.poll_kv_events:
            await self._poll_kv_events(client, instance)

    def served_adapters(self) -> frozenset[str]:
        """Gives the adapter names any instance serves (lists, or runs or queues requests of)."""
        return frozenset().union(*(i.adapters | (i.lora.held if i.lora else frozenset())
                                   for i in self.instances.values()))

    async def _poll_adapters(self, client: httpx.AsyncClient, instance: Instance) -> None:
        """Reads the adapters a LoRA engine serves from its /v1/models; failures only log."""
        try:
            response = await client.get(f"{instance.url}/v1/models", timeout=MODELS_TIMEOUT)
            response.raise_for_status()
            instance.adapters = served_adapters(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("GET %s/v1/models failed: %r", instance.url, exc)

    async def _poll_kv_events(self, client: httpx.AsyncClient, instance: Instance) -> None:
        """Applies the instance's new KV events to the prefix index; failures only log.

        The engine bounds an answer to its ring (65,536 events); a gap arrives as a
        `cleared` event, which resets the instance's entries.
        """
        target = f"/kv_events?since={instance.kv_events_next}"
        try:
            response = await client.get(instance.url + target, timeout=KV_EVENTS_TIMEOUT,
                                        headers=self.auth.fleet_headers("GET", target))
            response.raise_for_status()
            body = response.json()
            events = [parse_event(event) for event in body["events"]]
            next_seq = int(body["next"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            # An engine without events (404) or a slow one is not unhealthy: /metrics says that.
            # A refusal is a fleet whose members hold different secrets: say so.
            if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == 401:
                self.kv_events_refusals.warn(instance.url, "GET %s/kv_events failed: %r",
                                             instance.url, exc)
            else:
                log.debug("GET %s/kv_events failed: %r", instance.url, exc)
            return
        if self.instances.get(instance.url) is not instance:
            return  # it left (or changed role) while we waited
        for event in events:
            self.index.apply(instance.url, event)
        instance.kv_events_next = next_seq
