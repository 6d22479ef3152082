"""The router's HTTP app: OpenAI endpoints proxied to the chosen engine instances."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpilot.engine.contracts.fleet_secret import FleetSecret
from kvpilot.engine.contracts.http_auth import HttpAuth
from kvpilot.engine.contracts.kv_client import request_pull
from kvpilot.engine.contracts.kv_protocol import ProtocolError, kv_address
from kvpilot.engine.contracts.lora import lora_root_hash
from kvpilot.engine.contracts.openai_errors import BodyError, error_object, parse_body
from kvpilot.engine.contracts.request_limits import BodyLimit
from kvpilot.engine.contracts.router_args import (
    INSTANCE_HEADER,
    PASSED_HEADERS,
    REQUEST_ID_HEADER,
    SERVED_BY_HEADER,
    RouterArgs,
    parse_peers,
)
from kvpilot.engine.contracts.tokenizer import TokenizerLike
from kvpilot.engine.contracts.version import kvpilot_version
from kvpilot.engine.router.auth import authorizer
from kvpilot.engine.router.disagg import (
    FirstToken,
    SkipSent,
    disaggregatable,
    early_first_token,
    run_prefill,
)
from kvpilot.engine.router.discovery import Discovery, make_discovery
from kvpilot.engine.router.fleet import Fleet, Instance
from kvpilot.engine.router.flow_control import ClientSide
from kvpilot.engine.router.kv_events import MAX_BODY_BYTES, parse_event
from kvpilot.engine.router.latency_tracker import RequestLatency
from kvpilot.engine.router.lora import lora_candidates
from kvpilot.engine.router.metrics import RouterMetrics
from kvpilot.engine.router.policy import Weights, choose, hit_blocks
from kvpilot.engine.router.prefix_index import PrefixIndex
from kvpilot.engine.router.prompt import PromptHasher
from kvpilot.engine.router.proxy import Forwarder, GuardedTransport, NoInstance, sse_error
from kvpilot.engine.router.response_store import ResponseStore
from kvpilot.engine.router.responses_routes import add_responses_routes
from kvpilot.engine.router.scheduling import Scheduling

log = logging.getLogger("kvpilot.router")
OPENAI_POST_PATHS = ("/v1/completions", "/v1/chat/completions")
POLL_SECONDS = 0.2
STARTING_POLL = 0.25
STALL_TICK = 0.1  # how often the stall rule runs (cheap: a pass over the instances)
LARGE_BODY_BYTES = 1 << 20


class Router:
    """Picks instances and forwards requests; the state behind the HTTP app."""

    def __init__(self, args: RouterArgs, discovery: Discovery, hasher: PromptHasher,
                 auth: HttpAuth) -> None:
        self.args = args
        self.auth = auth
        self.index = PrefixIndex(args.prefix_index_max_entries)
        self.fleet = Fleet(discovery, self.index, eject_after=args.eject_after_failures,
                           eject_seconds=args.eject_seconds, auth=auth)
        self.hasher = hasher
        self.fleet.poll_kv_events = hasher.tokenizer is not None
        self.metrics = RouterMetrics()
        self.fleet.on_eject = lambda instance: self.metrics.ejections.labels(instance.url).inc()
        self.weights = Weights(args.load_weight, args.kv_usage_weight, args.cache_weight)
        self.counter = itertools.count()
        timeout = httpx.Timeout(connect=args.connect_timeout, read=args.idle_timeout,
                                write=args.idle_timeout, pool=args.connect_timeout)
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
        # every request to an engine carries the router's API key (the fleet shares one)
        self.client = httpx.AsyncClient(
            timeout=timeout, headers=auth.user_headers(),
            transport=GuardedTransport(httpx.AsyncHTTPTransport(limits=limits)))
        self.forwarder = Forwarder(self.fleet, self.client, self.metrics,
                                   max_retries=args.max_retries,
                                   request_timeout=args.request_timeout,
                                   max_migrations=args.max_migrations,
                                   hold_timeout=args.hold_timeout)
        self.scheduling = Scheduling(args, self.fleet, self.metrics, self.serving_roles)
        self.forwarder.on_release = self.scheduling.load_changed

    @property
    def disaggregated(self) -> bool:
        """Whether requests go prefill -> decode (both roles present, no aggregated ones)."""
        roles = {i.role for i in self.fleet.instances.values()}
        return "both" not in roles and {"prefill", "decode"} <= roles

    def serving_roles(self) -> tuple[str, ...]:
        """Gives the roles whose load flow control gates on: the replicas requests stream from."""
        return ("decode",) if self.disaggregated else ("both",)

    async def pick(self, roles: tuple[str, ...], hashes: list[int], exclude: set[str],
                   pinned: str | None = None, adapter: str | None = None,
                   trip: RequestLatency | None = None) -> Instance:
        """Gives the instance the policy picks, waiting up to hold_timeout for one; an
        `adapter` request's choice is narrowed first (`router.lora`); a `trip` is placed by
        predicted latency under that policy and told where it went."""
        deadline = time.monotonic() + self.args.hold_timeout
        gauge = self.metrics.pending.labels(roles[0])
        gauge.inc()
        try:
            while True:
                ready = self.fleet.available(roles)
                if pinned:
                    ready = [i for i in ready if i.url == pinned.rstrip("/")]
                candidates = [i for i in ready if i.url not in exclude]
                if candidates:
                    break
                if ready:  # only instances this request already failed on: no use waiting
                    raise NoInstance(f"every ready {'/'.join(roles)} instance was tried")
                if time.monotonic() >= deadline:
                    raise NoInstance(f"no ready {'/'.join(roles)} instance within "
                                     f"hold_timeout={self.args.hold_timeout}s")
                self.fleet.changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.fleet.changed.wait(), POLL_SECONDS)
        finally:
            gauge.dec()
        candidates = self.scheduling.with_room(roles, candidates)
        tiers = {i.url: self.index.match_tiers(i.url, hashes) for i in candidates}
        hits = {url: hit_blocks(gpu, host, self.weights) for url, (gpu, host) in tiers.items()}
        views = [i.view(self.index.size(i.url)) for i in candidates]
        if adapter is not None:
            views, outcome = lora_candidates(views, {i.url: i.lora for i in candidates},
                                             adapter, self.args.lora_affinity_margin)
            self.metrics.lora_requests.labels(outcome).inc()
        counter = next(self.counter)
        url = self.scheduling.place(trip, {v.url: tiers[v.url] for v in views}, counter)
        if url is None:  # any other policy, or a model still cold: prefix-aware stands in
            policy = "prefix-aware" if self.scheduling.predicted else self.args.policy
            url = choose(policy, views, counter=counter, hits=hits, num_blocks=len(hashes),
                         weights=self.weights).url
        chosen = self.fleet.instances[url]
        self.scheduling.started(trip, chosen, tiers.get(chosen.url, (0, 0)))
        self.metrics.prompt_blocks.inc(len(hashes))
        self.metrics.prefix_hit_blocks.inc(sum(tiers.get(chosen.url, (0, 0))))
        # The chosen instance will hold these blocks once it ran the prompt.
        self.index.insert(chosen.url, hashes)
        return chosen

    def _prefill_result(self, instance: Instance, healthy: bool, refused: bool = False) -> None:
        if healthy:
            self.fleet.succeeded(instance)
        else:
            self.fleet.failed(instance, "prefill failed", refused)

    async def handle(self, path: str, body: dict[str, Any], headers: dict[str, str],
                     pinned: str | None, client: ClientSide | None = None) -> Response:
        """Gives the response to one OpenAI request (aggregated or disaggregated), after flow
        control lets it go (`router.scheduling`)."""
        model = body.get("model")
        adapter = model if isinstance(model, str) and model in self.fleet.served_adapters() \
            else None
        # Engines root an adapter's block hashes at the adapter (a prefix cache never mixes
        # adapters): the router chains its hashes the same way, so they match the engines'.
        hashes = await asyncio.to_thread(self.hasher.hashes, body, lora_root_hash(adapter))
        trip = await self.scheduling.begin(
            body, hashes, client, lambda i: self.index.match_tiers(i.url, hashes))
        if isinstance(trip, Response):
            return trip
        if trip.admission.engine_priority is not None:  # flow control's order, in the engine
            body = {**body, "priority": trip.admission.engine_priority}
        try:
            response = await self._route(path, body, headers, pinned, adapter, hashes, trip)
        except BaseException:
            trip.admission.ended()  # no response: in transit and in flight no more
            raise
        return trip.finish(response)

    async def _route(self, path: str, body: dict[str, Any], headers: dict[str, str],
                     pinned: str | None, adapter: str | None, hashes: list[int],
                     trip: RequestLatency) -> Response:
        """Gives the response of the replica(s) the request goes to."""
        short = len(hashes) * self.args.block_size < self.args.disagg_min_prompt_tokens
        # a pinned stream stays where it was pinned: it does not move to another instance
        unmovable = f"pinned to {pinned} by {INSTANCE_HEADER}" if pinned else None
        if not self.disaggregated or not disaggregatable(body) or short:
            roles = ("decode",) if self.disaggregated else ("both",)
            if self.disaggregated and short:
                self.metrics.requests.labels("", "local_prefill").inc()

            async def pick_both(tried: set[str]) -> Instance:
                return await self.pick(roles, hashes, tried, pinned, adapter, trip)

            async def resume_both(tried: set[str]) -> Instance:  # the trip is over by then
                return await self.pick(roles, hashes, tried, pinned, adapter)
            return await self.forwarder.send(pick_both, path, body, headers,
                                             resume_pick=resume_both, unmovable=unmovable)

        async def pick_prefill(tried: set[str]) -> Instance:
            return await self.pick(("prefill",), hashes, tried)

        early = early_first_token(body)
        prefill, lease_id, reply = await run_prefill(
            self.client, pick_prefill, path, body, headers, self.args.max_retries + 1,
            self._prefill_result, token_ids=early)
        decode = await self._pick_or_none(("decode",), hashes, pinned)

        async def pick_decode(tried: set[str]) -> Instance:
            if decode is not None and not tried:
                trip.admission.begun()
                return decode
            return await self.pick(("decode",), hashes, tried, pinned)

        first = FirstToken.of(reply, "messages" in body) if early else None
        if prefill is not None and lease_id is not None and first is not None:
            self.metrics.requests.labels(prefill.url, "first_token_from_prefill").inc()
            served = ",".join(filter(None, [prefill.url, decode.url if decode else ""]))
            return StreamingResponse(
                self._decode_after_first(first, prefill, decode, pick_decode, path, body,
                                         headers, hashes, pinned),
                media_type="text/event-stream",
                headers={SERVED_BY_HEADER: served})
        if prefill is None or lease_id is None:
            self.metrics.requests.labels(prefill.url if prefill else "", "prefill_fallback").inc()
            log.warning("no prefill succeeded: the decode instance prefills locally")
        elif decode is not None:
            await self._transfer(prefill, decode, lease_id)
        return await self.forwarder.send(pick_decode, path, body, headers,
                                         served_by=prefill.url if prefill else "",
                                         unmovable=unmovable)

    async def _decode_after_first(self, first: FirstToken, prefill: Instance,
                                  decode: Instance | None,
                                  pick_decode: Callable[[set[str]], Awaitable[Instance]],
                                  path: str, body: dict[str, Any], headers: dict[str, str],
                                  hashes: list[int], pinned: str | None
                                  ) -> AsyncIterator[bytes]:
        """Streams the prefill's first token, then the decode instance's answer to the same
        body with that token given (`first_token_id`) and its text stripped (`SkipSent`); a
        decode leg that breaks moves to another decode instance."""
        yield first.events()
        if decode is not None:
            await self._transfer(prefill, decode, first.request_id)
        skip = SkipSent(first)

        async def resume_decode(tried: set[str]) -> Instance:
            return await self.pick(("decode",), hashes, tried, pinned)
        response = await self.forwarder.send(
            pick_decode, path, {**body, "first_token_id": first.token_id},
            {**headers, REQUEST_ID_HEADER: first.request_id}, served_by=prefill.url,
            resume_pick=resume_decode, on_migrate=skip.clear,
            unmovable=f"pinned to {pinned} by {INSTANCE_HEADER}" if pinned else None)
        if not isinstance(response, StreamingResponse):  # failed before its first byte
            try:
                message = str(json.loads(bytes(response.body))["error"]["message"])
            except (ValueError, KeyError, TypeError):
                message = "the decode instance failed"
            yield sse_error(message, response.status_code)
            yield b"data: [DONE]\n\n"
            return
        chunks = response.body_iterator
        try:
            async for data in chunks:
                yield skip.feed(data if isinstance(data, bytes) else str(data).encode())
        finally:  # the client may go: the relay's own clean-up (counts, connection) runs now
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()

    async def _pick_or_none(self, roles: tuple[str, ...], hashes: list[int],
                            pinned: str | None) -> Instance | None:
        try:
            return await self.pick(roles, hashes, set(), pinned)
        except NoInstance:
            return None

    async def _transfer(self, prefill: Instance, decode: Instance, lease_id: str) -> None:
        """Has the decode instance pull the lease; a failure only costs a local prefill."""
        offset = self.args.kv_port_offset
        try:
            done = await request_pull(kv_address(decode.url, 0, offset),
                                      kv_address(prefill.url, 0, offset), lease_id,
                                      self.args.transfer_timeout, self.auth.fleet.kv_key)
            self.metrics.transferred_blocks.inc(done.get("imported", 0))
        except (OSError, ProtocolError, TimeoutError) as exc:
            self.metrics.requests.labels(decode.url, "transfer_fallback").inc()
            log.warning("KV transfer %s -> %s failed, decode prefills locally: %r",
                        prefill.url, decode.url, exc)

    async def watch_stalls_forever(self) -> None:
        """Ejects stalled instances (`router.stall`) within STALL_TICK of their timeout."""
        while True:
            await asyncio.sleep(STALL_TICK)
            self.fleet.check_stalls(self.args.stall_timeout)

    async def refresh_forever(self) -> None:
        """Refreshes discovery and load every refresh_interval seconds."""
        while True:
            await self.fleet.refresh(self.client)
            self.scheduling.forget_gone()
            self.scheduling.load_changed()
            self._export_fleet_gauges()
            # Instances still starting are polled often, so they join as soon as they are up.
            interval = self.args.refresh_interval
            await asyncio.sleep(interval if self.fleet.all_ready else min(interval, STARTING_POLL))

    def _export_fleet_gauges(self) -> None:
        now = time.monotonic()
        self.metrics.healthy.clear()
        for role in ("both", "prefill", "decode"):
            members = [i for i in self.fleet.instances.values() if i.role == role]
            ready = sum(i.ready and i.health.available(now) for i in members)
            self.metrics.healthy.labels(role, "ready").set(ready)
            self.metrics.healthy.labels(role, "not_ready").set(len(members) - ready)
        self.metrics.index_entries.set(len(self.index))


def build_app(args: RouterArgs, discovery: Discovery | None = None,
              tokenizer: TokenizerLike | None = None) -> FastAPI:
    """Gives the FastAPI app of a router configured by `args`; with the engines' `tokenizer`
    its prompt hashes equal theirs (`--tokenizer`)."""
    fleet_secret = FleetSecret.from_file(args.fleet_secret_file)
    auth = HttpAuth(args.api_key, fleet_secret, args.metrics_require_api_key)
    hasher = PromptHasher(args.block_size, tokenizer, fleet_secret.block_hash_salt)
    router = Router(args, discovery or make_discovery(args), hasher, auth)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(router.refresh_forever())]
        if args.stall_timeout:
            tasks.append(asyncio.create_task(router.watch_stalls_forever()))
        if router.scheduling.flow is not None:
            tasks.append(asyncio.create_task(router.scheduling.flow.run_forever()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            router.fleet.close()
            await router.client.aclose()

    app = FastAPI(title="kvpilot router", lifespan=lifespan,
                  dependencies=[Depends(authorizer(auth, MAX_BODY_BYTES))])
    app.state.router = router
    app.add_middleware(BodyLimit, max_bytes=args.max_request_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = None  # as the engine's: a 401 names the credential
        if exc.status_code == 401:
            fleet = auth.kind(request.url.path) == "fleet"
            code = "invalid_fleet_auth" if fleet else "invalid_api_key"
        return JSONResponse(error_object(exc.status_code, str(exc.detail), code=code),
                            exc.status_code, headers=exc.headers)

    async def openai_post(request: Request) -> Response:
        raw = await request.body()
        try:  # what an engine would refuse too, in the engine's words (`openai_errors`)
            # a large body parses off the loop (16 MB: ~30 ms the other requests would wait)
            body = parse_body(raw) if len(raw) < LARGE_BODY_BYTES else \
                await asyncio.to_thread(parse_body, raw)
        except BodyError as exc:
            return JSONResponse(error_object(400, str(exc)), 400)
        headers = {k: v for k, v in request.headers.items() if k in PASSED_HEADERS}
        return await router.handle(request.url.path, body, headers,
                                   request.headers.get(INSTANCE_HEADER),
                                   ClientSide(request.headers, request.receive))

    for path in OPENAI_POST_PATHS:
        app.add_api_route(path, openai_post, methods=["POST"])

    add_responses_routes(app, router, ResponseStore(
        args.response_store_max_entries, args.response_store_ttl,
        parse_peers(args.response_store_peers), auth))

    @app.get("/v1/models")
    async def models() -> Response:
        for instance in router.fleet.available(("both", "decode")):
            try:
                response = await router.client.get(instance.url + "/v1/models")
            except httpx.HTTPError:
                continue
            return Response(response.content, response.status_code,
                            media_type=response.headers.get("content-type"))
        return JSONResponse(error_object(503, "no ready instance", code="no_instance"), 503)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvpilot_version()}

    @app.get("/ready")
    async def ready() -> Response:
        serving = ("prefill", "decode") if router.disaggregated else ("both",)
        missing = [r for r in serving if not router.fleet.available((r,))]
        if missing:
            return JSONResponse({"status": "not ready", "missing_roles": missing}, 503)
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        router._export_fleet_gauges()
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/kv_events")
    async def kv_events(request: Request) -> Response:
        """Takes an engine's KV events: {"instance", "stored": [hash], "removed": [hash],
        "cleared"}, each bounded (`router.kv_events`); 400 naming the field otherwise."""
        try:
            event = parse_event(request.state.body)  # read, bounded, by `authorizer`
        except ValueError as exc:
            param = str(exc).partition("=")[0]
            return JSONResponse(error_object(400, str(exc), param), 400)
        instance = router.fleet.instances.get(event.instance.rstrip("/"))
        if instance is not None:  # the index holds nothing of any other
            router.index.apply(instance.url, event)
        return JSONResponse({"entries": len(router.index)})

    return app
