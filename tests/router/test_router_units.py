"""Health records, discovery parsing, load scraping, flags and the torch-free import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from router_fake_engine import serving

from kvpilot.engine.contracts.block_hash import hash_prompt_blocks
from kvpilot.engine.contracts.router_args import SERVED_BY_HEADER, RouterArgs, parse_instances
from kvpilot.engine.router.discovery import EndpointSliceDiscovery, endpoints_from_slices
from kvpilot.engine.router.fleet import parse_load
from kvpilot.engine.router.health import Health
from kvpilot.engine.router.prompt import PromptHasher


@pytest.mark.parametrize(("events", "eject_after", "ejected_at", "available_at_end"), [
    # events: (time, ok?) ; ejected_at: times at which a failure ejected it
    ([(0, False), (1, False)], 3, [], True),
    ([(0, False), (1, False), (2, False)], 3, [2], False),
    ([(0, False), (1, False), (2, True), (3, False)], 3, [], True),  # success resets
    ([(0, False)], 1, [0], False),
    # back after 10 s, on probation: one more failure ejects again, for 20 s
    ([(0, False), (11, False)], 1, [0, 11], False),
    ([(0, False), (11, False), (32, True), (33, False)], 1, [0, 11, 33], False),
])
def test_health_ejection_table(events, eject_after, ejected_at, available_at_end):
    health, ejections = Health(), []
    for now, ok in events:
        if ok:
            health.record_success()
        elif health.record_failure(now, eject_after, eject_seconds=10):
            ejections.append(now)
    assert ejections == ejected_at
    assert health.available(events[-1][0]) is available_at_end


def test_ejection_backoff_doubles_up_to_eight_times():
    health, until = Health(), []
    now = 0.0
    for _ in range(5):
        assert health.record_failure(now, 1, 10)
        until.append(health.ejected_until - now)
        now = health.ejected_until
    assert until == [10, 20, 40, 80, 80]


def slice_(role, port_name, port, endpoints):
    labels = {"kvpilot.dev/role": role} if role else {}
    return {"metadata": {"labels": labels}, "ports": [{"name": port_name, "port": port}],
            "endpoints": endpoints}


@pytest.mark.parametrize(("items", "expected"), [
    ([slice_("prefill", "http", 8000, [{"addresses": ["10.0.0.1"],
                                        "conditions": {"ready": True}}])],
     [("prefill", "http://10.0.0.1:8000")]),
    ([slice_(None, "http", 8000, [{"addresses": ["10.0.0.2"]}])],  # no role, ready unknown
     [("both", "http://10.0.0.2:8000")]),
    ([slice_("decode", "http", 8000, [{"addresses": ["10.0.0.3"],
                                       "conditions": {"ready": False}}])], []),
    ([slice_("decode", "metrics", 9000, [{"addresses": ["10.0.0.4"]}])], []),  # wrong port
    ([slice_("decode", "http", 8000, [{"addresses": ["fd00::1"]}])],
     [("decode", "http://[fd00::1]:8000")]),
])
def test_endpoints_from_slices(items, expected):
    assert endpoints_from_slices({"items": items}, "http") == expected


@pytest.mark.parametrize(("text", "expected"), [
    ("http://a:1", [("both", "http://a:1")]),
    ("http://a:1/, prefill=http://b:2,decode=https://c:3", [
        ("both", "http://a:1"), ("prefill", "http://b:2"), ("decode", "https://c:3")]),
])
def test_parse_instances(text, expected):
    assert parse_instances(text) == expected


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"instances": "warmup=http://a:1"}, "role 'warmup'"),
    ({"instances": "a:1"}, "not an http"),
    ({"instances": ","}, "names no instance"),
    ({}, "instances=None is invalid"),
    ({"discovery": "kubernetes"}, "selector=None is invalid"),
    ({"instances": "http://a:1", "policy": "random"}, "policy='random' is invalid"),
    ({"instances": "http://a:1", "max_retries": -1}, "max_retries=-1 is invalid"),
    ({"instances": "http://a:1", "block_size": 0}, "block_size=0 is invalid"),
])
def test_router_args_errors_name_the_field(kwargs, error):
    with pytest.raises(ValueError, match=error):
        RouterArgs(**kwargs)


def test_router_args_round_trip_through_the_cli():
    from kvpilot.cli.main import build_parser
    args = RouterArgs(instances="http://a:1", policy="least-load", port=9000, api_key="k")
    parsed = build_parser("route").parse_args(["route", *args.to_cli()])
    from kvpilot.engine.contracts.args import from_namespace
    assert from_namespace(RouterArgs, parsed) == args


@pytest.mark.parametrize(("text", "expected"), [
    ('vllm:num_requests_waiting{model_name="m"} 3.0\n'
     'vllm:num_requests_running{model_name="m"} 2.0\n'
     'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n', (3.0, 2.0, 0.5)),
    ('vllm:num_requests_waiting{model_name="a"} 1\nvllm:num_requests_waiting{model_name="b"} 2\n',
     (3.0, 0.0, 0.0)),
    ("# HELP other x\nother 5\n", (0.0, 0.0, 0.0)),
])
def test_parse_load(text, expected):
    assert parse_load(text) == expected


class TemplateTokenizer:
    """A chat template over plain-string contents (as the engine server renders them)."""

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = False) -> str:
        assert set().union(*messages) <= {"role", "content"}, messages
        return "".join(f"[{m['role']}]{m['content'] + ''}" for m in messages) + "[assistant]"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize(("messages", "rendered"), [
    ([{"role": "user", "content": "hi"}], "[user]hi[assistant]"),
    ([{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}],
     "[user]hi[assistant]"),
    ([{"role": "user", "content": "hi", "name": "ann"}], "[user]hi[assistant]"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "q"}],
     "[system][user]q[assistant]"),
])
def test_chat_hashes_render_messages_as_the_engine_server_does(messages, rendered):
    hasher = PromptHasher(2, TemplateTokenizer())
    assert hasher.hashes({"messages": messages}) == hash_prompt_blocks(
        [ord(c) for c in rendered], 2)


@pytest.mark.parametrize("body", [
    {"prompt": "\ud800" * 200},  # a lone surrogate: the tokenizer raised TypeError (a 500)
    {"prompt": ["a\udc00b" * 100, "fine"]},  # a batch routes by its first prompt
    {"messages": [{"role": "user", "content": "x\ud800" * 100}]},
    {"messages": "hi"},  # not a list of objects
    {"messages": [1, 2]},
    {"prompt": [2**40] * 100},  # ids beyond int32
])
@pytest.mark.parametrize("tokenizer", [None, "tiny-llama"])
def test_a_prompt_the_router_cannot_read_gets_no_hashes(body, tokenizer):
    """The engine answers it with a 400 naming the field; the router must not fail first."""
    from kvpilot.engine.contracts.tokenizer import load_tokenizer

    hasher = PromptHasher(2, load_tokenizer(tokenizer) if tokenizer else None)
    assert hasher.hashes(body) == []


def test_router_import_leaves_torch_out():
    code = ("import sys; import kvpilot.engine.router.app, kvpilot.engine.router.cli; "
            "assert 'torch' not in sys.modules, 'router imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(("refused", "failures_to_eject"), [(False, 3), (True, 1)])
async def test_refused_connection_ejects_at_once(refused, failures_to_eject):
    from kvpilot.engine.router.discovery import StaticDiscovery
    from kvpilot.engine.router.fleet import Fleet
    from kvpilot.engine.router.prefix_index import PrefixIndex

    fleet = Fleet(StaticDiscovery("http://a:1"), PrefixIndex(10), eject_after=3,
                  eject_seconds=10)
    fleet.update([("both", "http://a:1")])
    instance = fleet.instances["http://a:1"]
    instance.ready = True
    ejected_at = next(n for n in range(1, 5) if fleet.failed(instance, "x", refused))
    assert ejected_at == failures_to_eject
    assert fleet.available(("both",)) == []


async def test_endpoint_slice_discovery_queries_the_api_server():

    seen: list[tuple[str, str | None, str | None]] = []
    api = FastAPI()

    @api.get("/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices")
    async def slices(namespace: str, request: Request) -> dict:
        seen.append((namespace, request.query_params.get("labelSelector"),
                     request.headers.get("authorization")))
        return {"items": [slice_("decode", "http", 8000, [{"addresses": ["10.1.0.7"]}])]}

    async with serving(api) as url:
        discovery = EndpointSliceDiscovery("serving", "kvpilot.dev/model=m,kvpilot.dev/role",
                                           "http", api_server=url, token="sa-token")
        assert await discovery.list() == [("decode", "http://10.1.0.7:8000")]
        await discovery.aclose()
    assert seen == [("serving", "kvpilot.dev/model=m,kvpilot.dev/role", "Bearer sa-token")]


def test_read_metrics_sums_over_label_sets_and_reads_buckets():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvpilot.engine.contracts.metrics_text import read_metrics

    registry = CollectorRegistry()
    steps = Counter("steps", "", ["mode"], registry=registry)
    steps.labels("graph").inc(3)
    steps.labels("eager").inc(2)
    Gauge("waiting", "", registry=registry).set(4)
    Histogram("ttft_seconds", "", buckets=(0.1, 1.0), registry=registry).observe(0.5)
    text = generate_latest(registry).decode()
    # the counter's `_created` timestamps come as a gauge family of their own: not summed in
    assert "steps_created" in text
    sums, buckets = read_metrics(text, ["steps", "waiting"], ["ttft_seconds"])
    assert sums == {"steps": 5.0, "waiting": 4.0}
    assert buckets == {"ttft_seconds": {0.1: 0.0, 1.0: 1.0, float("inf"): 1.0}}
    only_graph, _ = read_metrics(text, ["steps"], labels={"mode": "graph"})
    assert only_graph == {"steps": 3.0}


@pytest.mark.parametrize("tokenizer", [None, "tiny-llama"])
def test_a_huge_prompt_is_hashed_by_its_front_only(tokenizer):
    """A 16 MB prompt took the router seconds to hash whole; it hashes MAX_HASHED characters,
    and the blocks before the cut equal the whole prompt's."""
    from kvpilot.engine.contracts.tokenizer import load_tokenizer
    from kvpilot.engine.router.prompt import MAX_HASHED

    hasher = PromptHasher(16, load_tokenizer(tokenizer) if tokenizer else None)
    huge = hasher.hashes({"prompt": "lorem ipsum dolor sit amet " * (16 * 2**20 // 27)})
    front = hasher.hashes({"prompt": "lorem ipsum dolor sit amet " * (MAX_HASHED // 27 - 10)})
    assert len(huge) <= MAX_HASHED // 16 and huge[:len(front) - 2] == front[:-2]


def test_the_router_does_not_log_its_scrapes_at_info(tmp_path):
    """Two INFO lines per engine every --refresh-interval (httpx's request log) (issue 49)."""
    import time

    from kvpilot.operator.local.supervisor import free_port

    engine_port, router_port = free_port(), free_port()
    fake = subprocess.Popen([sys.executable, str(Path(__file__).parent / "router_fake_engine.py"),
                             str(engine_port), "e"])
    router = subprocess.Popen([sys.executable, "-m", "kvpilot.cli", "route", "--instances",
                               f"http://127.0.0.1:{engine_port}", "--port", str(router_port),
                               "--refresh-interval", "0.05"],
                              stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(3)  # ~60 scrapes of the engine
    finally:
        router.terminate()
        fake.terminate()
        _, err = router.communicate(timeout=30)
        fake.wait(30)
    assert "HTTP Request" not in err, err[-2000:]


@pytest.mark.parametrize(("level", "access_log"), [("info", False), ("debug", True)])
def test_the_router_serves_with_a_settled_gc_and_an_access_log_only_when_debugging(
        level, access_log):
    # in a process of its own: the start-up heap it freezes stays frozen
    code = f"""
import argparse, gc, uvicorn
from kvpilot.engine.router import cli
seen = {{}}
def serve(self, sockets=None):
    seen.update(access_log=self.config.access_log, frozen=gc.get_freeze_count(),
                young=gc.get_threshold()[0])
uvicorn.Server.run = serve
parser = argparse.ArgumentParser()
cli.add_arguments(parser)
assert cli.run(parser.parse_args(["--instances", "both=http://127.0.0.1:9", "--port", "0",
                                  "--log-level", "{level}"])) == 0
print(seen["access_log"], seen["frozen"] > 0, seen["young"])
"""
    from kvpilot.engine.contracts.streaming_gc import GC_YOUNG_OBJECTS

    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.split()
    assert out == [str(access_log), "True", str(GC_YOUNG_OBJECTS)]


async def test_a_fault_inside_the_http_stack_is_retried_on_another_instance():
    """Through the router's transport (`GuardedTransport`), a send that fails inside the HTTP
    stack with neither an HTTP nor an OS error (anyio's AttributeError on a socket its peer
    closed as it connected, seen in the chaos test) is a failed try: the request goes to the
    next instance instead of becoming a 500."""
    from kvpilot.engine.router.discovery import StaticDiscovery
    from kvpilot.engine.router.fleet import Fleet
    from kvpilot.engine.router.metrics import RouterMetrics
    from kvpilot.engine.router.prefix_index import PrefixIndex
    from kvpilot.engine.router.proxy import Forwarder, GuardedTransport, NoInstance

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a" and request.url.path == "/v1/completions":
            raise AttributeError("'NoneType' object has no attribute 'getpeername'")
        return httpx.Response(200, headers={"content-type": "application/json"},
                              stream=httpx.ByteStream(b'{"choices": [{"text": "ok"}]}'))

    fleet = Fleet(StaticDiscovery("http://a:1,http://b:2"), PrefixIndex(1000), eject_after=3,
                  eject_seconds=1)
    async with httpx.AsyncClient(transport=GuardedTransport(httpx.MockTransport(handler))
                                 ) as client:
        await fleet.refresh(client)
        forwarder = Forwarder(fleet, client, RouterMetrics(), max_retries=2,
                              request_timeout=10.0)

        async def pick(exclude: set[str]):
            for url in ("http://a:1", "http://b:2"):  # a first
                if url not in exclude:
                    return fleet.instances[url]
            raise NoInstance("none left")

        response = await forwarder.send(pick, "/v1/completions", {"prompt": "hi"}, {})
    assert response.status_code == 200
    assert response.headers[SERVED_BY_HEADER] == "http://b:2"
