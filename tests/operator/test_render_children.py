"""What an InferenceModel renders into, and that pods' command lines parse as the CLIs' own flags."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvpilot.engine.contracts.args import EngineArgs, ServerArgs, from_namespace
from kvpilot.engine.contracts.router_args import RouterArgs
from kvpilot.engine.contracts.router_objectives import parse_objectives
from kvpilot.engine.router import cli as route_cli
from kvpilot.engine.server import cli as serve_cli
from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import DecodePoolSpec, PrefillPoolSpec
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool

IM = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
      "metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 4}}
TINY = {"model": {"name": "chat", "source": "dummy:tiny-llama"}, "accelerator": {"vendor": "cpu"}}


def render(spec: InferenceModelSpec) -> list[dict[str, Any]]:
    return render_children(IM, spec, owned_pools(spec, "chat"), RenderConfig())


def children(**spec: Any) -> list[dict[str, Any]]:
    return render(InferenceModelSpec.model_validate({**TINY, **spec}))


def parse(add_arguments: Any, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(("spec", "pools"), [
    ({}, [("DecodePool", "chat-decode", "both", 1)]),
    ({"decode": {"replicas": 3}}, [("DecodePool", "chat-decode", "both", 3)]),
    ({"servingMode": "disaggregated", "prefill": {"replicas": 2}},
     [("PrefillPool", "chat-prefill", "prefill", 2), ("DecodePool", "chat-decode", "decode", 1)]),
])
def test_pools_by_serving_mode(spec, pools):
    objects = children(**spec)
    got = [(o["kind"], o["metadata"]["name"], o["spec"]["role"], o["spec"]["replicas"])
           for o in objects if o["kind"].endswith("Pool")]
    assert got == pools
    for obj in objects:
        ref = obj["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("InferenceModel", "u1", True)
        assert obj["metadata"]["labels"]["kvpilot.dev/model"] == "chat"


def test_pools_carry_resolved_sections_and_the_model_generation():
    pool = next(o for o in children(topology={"tensorParallel": 2}) if o["kind"] == "DecodePool")
    assert pool["spec"]["modelRef"] == "chat"
    assert pool["spec"]["topology"]["tensorParallel"] == 2
    assert pool["spec"]["accelerator"]["vendor"] == "cpu"
    assert pool["metadata"]["annotations"]["kvpilot.dev/model-generation"] == "4"


@pytest.mark.parametrize(("replicas", "router_kinds"), [
    (1, ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "NetworkPolicy"]),
    (0, []),
])
def test_router_objects_only_when_it_has_replicas(replicas, router_kinds):
    objects = children(router={"replicas": replicas})
    got = [o["kind"] for o in objects if o["metadata"]["name"] == "chat-router"]
    assert got == router_kinds


def test_router_command_parses_as_kvpilot_route():
    deployment = next(o for o in children(router={"policy": "least-load"})
                      if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kvpilot", "route"]
    args: RouterArgs = from_namespace(RouterArgs, parse(route_cli.add_arguments,
                                                        container["args"]))
    assert (args.discovery, args.namespace, args.policy, args.port) == (
        "kubernetes", "ns", "least-load", 8080)
    assert args.selector == "kvpilot.dev/model=chat,kvpilot.dev/role"
    assert args.tokenizer == "tiny-llama"


def test_router_flow_control_and_objectives_render_into_kvpilot_route():
    router = {"policy": "predicted-latency",
              "flowControl": {"saturationQueueDepth": 3, "maxQueuedPerFlow": 5,
                              "queueTimeoutSeconds": 7.5, "sloUnmeetable": "shed"},
              "objectives": [{"name": "premium", "priority": 10, "models": ["chat"],
                              "ttftMs": 400}, {"name": "batch", "priority": -2}]}
    deployment = next(o for o in children(router=router) if o["kind"] == "Deployment")
    argv = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    args: RouterArgs = from_namespace(RouterArgs, parse(route_cli.add_arguments, argv))
    assert (args.policy, args.flow_control, args.saturation_queue_depth,
            args.max_queued_per_flow, args.max_queued_requests, args.queue_timeout,
            args.slo_unmeetable) == ("predicted-latency", True, 3, 5, 1024, 7.5, "shed")
    assert args.objectives is not None
    assert [o.to_json() for o in parse_objectives(args.objectives)] == [
        {"name": "premium", "priority": 10, "models": ["chat"], "ttftMs": 400.0},
        {"name": "batch", "priority": -2}]
    plain = next(o for o in children() if o["kind"] == "Deployment")
    assert "--flow-control" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize(("mode", "role"), [("aggregated", "both"), ("disaggregated", "decode")])
def test_engine_command_parses_as_kvpilot_serve(mode, role):
    spec = InferenceModelSpec.model_validate({
        **TINY, "servingMode": mode, "prefill": {} if mode == "disaggregated" else None,
        "engine": {"maxNumSeqs": 32, "blockSize": 32, "kvCacheMemory": "512MiB",
                   "extraArgs": ["--seed", "7"]},
        "topology": {"tensorParallel": 2}})
    objects = render(spec)
    pool = next(o for o in objects if o["kind"] == "DecodePool")
    pool = {**pool, "metadata": {**pool["metadata"], "uid": "u2"}}
    deployment = render_pool(pool, resolve_pool(DecodePoolSpec.model_validate(pool["spec"]), spec),
                             RenderConfig())[0]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    parsed = parse(serve_cli.add_arguments, container["args"])
    engine: EngineArgs = from_namespace(EngineArgs, parsed)
    server: ServerArgs = from_namespace(ServerArgs, parsed)
    assert (engine.model, engine.served_model_name, engine.load_format) == (
        "tiny-llama", "chat", "dummy")
    assert (engine.role, engine.tensor_parallel_size, engine.device) == (role, 2, "cpu")
    assert (engine.max_num_seqs, engine.block_size, engine.kv_cache_memory, engine.seed) == (
        32, 32, "512MiB", 7)
    assert (server.host, server.port) == ("0.0.0.0", 8000)
    configmap = next(o for o in objects if o["kind"] == "ConfigMap")
    assert configmap["data"][f"{role}.args"].split("\n") == container["args"]


def test_prefill_pool_spec_round_trips():
    spec = InferenceModelSpec.model_validate({**TINY, "servingMode": "disaggregated",
                                              "prefill": {"replicas": 2}})
    prefill = next(o for o in render(spec) if o["kind"] == "PrefillPool")
    assert PrefillPoolSpec.model_validate(prefill["spec"]).replicas == 2


@pytest.mark.parametrize(("router", "extra", "policy"), [
    ({}, [], "fcfs"),  # no flow control: the engine's default
    ({"flowControl": {}}, [], "priority"),  # the router's engine priorities are honoured
    ({"flowControl": {}}, ["--scheduling-policy", "fcfs"], "fcfs"),  # extraArgs decide
])
def test_flow_control_runs_the_engines_by_priority(router, extra, policy):
    spec = InferenceModelSpec.model_validate({**TINY, "router": router,
                                              "engine": {"extraArgs": extra}})
    pool = next(o for o in render(spec) if o["kind"] == "DecodePool")
    pool = {**pool, "metadata": {**pool["metadata"], "uid": "u2"}}
    deployment = render_pool(pool, resolve_pool(DecodePoolSpec.model_validate(pool["spec"]), spec),
                             RenderConfig())[0]
    argv = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    engine: EngineArgs = from_namespace(EngineArgs, parse(serve_cli.add_arguments, argv))
    assert engine.scheduling_policy == policy
