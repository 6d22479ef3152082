"""One contract between the operator's multi-node rendering and the engine: the env a
rendered group's pods get is exactly what `Rendezvous.from_env` reads, giving each pod its
ranks; two local processes started with that env (a TP=2 group split over two "pods")
answer an OpenAI request with the single-rank engine's tokens; and so do the two pods of a
PP=2 group the operator renders, run with their rendered command and env (the leader's
address mapped to this machine)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpilot.engine.contracts.args import EngineArgs, add_dataclass_args, from_namespace
from kvpilot.engine.contracts.rendezvous import Rendezvous
from kvpilot.engine.executor.processes import free_port, rendezvous_env
from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import SPEC_BY_KIND
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.meta import POD_INDEX_LABEL, RenderConfig
from kvpilot.operator.render.pool import render_pool
from kvpilot.operator.render.services import LWS_WORKER_INDEX_LABEL

GROUP_SPEC = {"model": {"name": "llama", "source": "dummy:tiny-llama", "numAttentionHeads": 64,
                        "numKeyValueHeads": 8, "numLayers": 80},
              "topology": {"tensorParallel": 8, "pipelineParallel": 2},
              "accelerator": {"vendor": "nvidia"}}


# one GPU per node: each of the two stages of tiny-llama is a pod of its own
PP_GROUP_SPEC = {"model": {"name": "tiny-llama", "source": "dummy:tiny-llama",
                           "numAttentionHeads": 4, "numKeyValueHeads": 2, "numLayers": 2},
                 "topology": {"pipelineParallel": 2},
                 "accelerator": {"vendor": "nvidia", "gpusPerNode": 1}}


def rendered_group(config: RenderConfig, group_spec: dict[str, Any] = GROUP_SPEC
                   ) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Gives (the multi-node workload, the pool's Service, its nodes) of `group_spec`."""
    spec = InferenceModelSpec.model_validate(group_spec)
    im = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
          "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1}}
    pool = next(o for o in render_children(im, spec, owned_pools(spec, "m"), config)
                if o["kind"] in SPEC_BY_KIND)
    pool = {**pool, "metadata": {**pool["metadata"], "uid": "p"}}
    resolved = resolve_pool(SPEC_BY_KIND[pool["kind"]].model_validate(pool["spec"]), spec)
    objects = render_pool(pool, resolved, config)
    group = next(o for o in objects if o["kind"] in ("StatefulSet", "LeaderWorkerSet"))
    service = next(o for o in objects if o["kind"] == "Service"
                   and o["spec"].get("clusterIP") != "None")
    return group, service, resolved.placement.nodes_per_replica


def pod_env(container: dict[str, Any], labels: dict[str, str]) -> dict[str, str]:
    """Gives the container's env as a pod with `labels` sees it (label fieldRefs resolved)."""
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        elif path := item["valueFrom"].get("fieldRef", {}).get("fieldPath", ""):
            match = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
            if match:
                env[item["name"]] = labels[match.group(1)]
    return env


def engine_args(container: dict[str, Any]) -> EngineArgs:
    import argparse

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineArgs)
    namespace, _ = parser.parse_known_args(container["args"])
    return from_namespace(EngineArgs, namespace)


@pytest.mark.parametrize(("config", "index_label"), [
    (RenderConfig(), POD_INDEX_LABEL),
    (RenderConfig(leader_worker_set=True), LWS_WORKER_INDEX_LABEL),
], ids=["statefulset", "leaderworkerset"])
def test_rendered_group_env_is_what_the_engine_reads(config, index_label):
    group, service, nodes = rendered_group(config)
    template = group["spec"].get("template") or \
        group["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    container = template["spec"]["containers"][0]
    args = engine_args(container)
    world = args.tensor_parallel_size * args.pipeline_parallel_size
    assert (world, nodes) == (16, 2)
    seen: list[int] = []
    for node in range(nodes):
        rendezvous = Rendezvous.from_env(pod_env(container, {index_label: str(node)}), world)
        assert rendezvous is not None
        assert rendezvous.master_port == 29500 and rendezvous.ranks_per_node == 8
        assert rendezvous.is_driver_node == (node == 0)
        seen += list(rendezvous.local_ranks)
    assert seen == list(range(16))  # every global rank on exactly one pod
    # only node rank 0's pod serves: the Service selects it alone
    assert service["spec"]["selector"][index_label] == "0"
    if not config.leader_worker_set:  # the leader's stable DNS name through the headless service
        assert pod_env(container, {index_label: "1"})["MASTER_ADDR"] == \
            "m-decode-g0-0.m-decode-workers.ns.svc"


TP2_FLAGS = ["--model", "tiny-llama", "--device", "cpu", "--tensor-parallel-size", "2",
             "--num-kv-blocks", "64", "--port", "0"]


def start_pod(env: dict[str, str], log: Path, pattern: str,
              flags: list[str] = TP2_FLAGS) -> tuple[subprocess.Popen, str]:
    """Starts one "pod" (`kvpilot serve` with the group env); gives it and its URL."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvpilot.cli.main", "serve", *flags],
            env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        found = re.search(pattern + r" (http://\S+)", log.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def pod_logs(tmp_path: Path) -> str:
    """Gives both pods' logs (for a failure's message)."""
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')}"
                     for log in sorted(tmp_path.glob("pod*.log")))


def test_two_pods_of_a_group_answer(tmp_path: Path):
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    want = LLM("tiny-llama", num_kv_blocks=64).generate(
        "the same rendered command on two pods",
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    group = Rendezvous("127.0.0.1", free_port(), world_size=2, nnodes=2, node_rank=0)
    pods = []
    try:
        worker, worker_url = start_pod(rendezvous_env(dataclasses.replace(group, node_rank=1)),
                                       tmp_path / "pod1.log", "answering probes on")
        pods.append(worker)
        leader, url = start_pod(rendezvous_env(group), tmp_path / "pod0.log", "listening on")
        pods.append(leader)
        deadline = time.monotonic() + 300
        while httpx.get(f"{url}/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        for probe in ("/health", "/ready"):
            assert httpx.get(worker_url + probe, timeout=30).status_code == 200
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": "the same rendered command on two pods",
            "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == want.rstrip("\ufffd")
        leader.terminate()  # drains, then stops its workers: the worker pod exits 0
        assert leader.wait(180) == 0, pod_logs(tmp_path)
        assert worker.wait(180) == 0, pod_logs(tmp_path)
    finally:
        for pod in pods:
            pod.kill()
            pod.wait(30)


def local_flags(args: list[str]) -> list[str]:
    """Gives a rendered pod's `kvpilot serve` flags as this machine runs them: CPU instead of
    the GPU, any free port on 127.0.0.1, no fleet Secret file (there is no Secret mount)."""
    out, values = [], iter(args)
    for flag in values:
        if flag in ("--device", "--host", "--port", "--fleet-secret-file"):
            next(values)
            continue
        out.append(flag)
    return [*out, "--device", "cpu", "--host", "127.0.0.1", "--port", "0"]


def test_rendered_pp2_group_answers(tmp_path: Path):
    from kvpilot.engine.contracts.sampling_params import SamplingParams
    from kvpilot.engine.entrypoints.llm import LLM

    group, _, nodes = rendered_group(RenderConfig(), PP_GROUP_SPEC)
    container = group["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["kvpilot", "serve"] and nodes == 2
    flags = local_flags(container["args"])
    assert flags[flags.index("--pipeline-parallel-size") + 1] == "2"
    prompt = "two stages on two pods"
    want = LLM("tiny-llama").generate(prompt, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].text
    port = str(free_port())  # the rendered 29500 may be taken on a shared machine
    envs = [{**pod_env(container, {POD_INDEX_LABEL: str(node)}), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": port} for node in range(nodes)]
    assert [(e["WORLD_SIZE"], e["NNODES"], e["NODE_RANK"]) for e in envs] == [
        ("2", "2", "0"), ("2", "2", "1")]
    pods = []
    try:
        worker, _ = start_pod(envs[1], tmp_path / "pod1.log", "answering probes on", flags)
        pods.append(worker)
        leader, url = start_pod(envs[0], tmp_path / "pod0.log", "listening on", flags)
        pods.append(leader)
        deadline = time.monotonic() + 300
        while httpx.get(f"{url}/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == want.rstrip("\ufffd")
        leader.terminate()  # drains, then stops the last stage: the worker pod exits 0
        assert leader.wait(180) == 0, pod_logs(tmp_path)
        assert worker.wait(180) == 0, pod_logs(tmp_path)
    finally:
        for pod in pods:
            pod.kill()
            pod.wait(30)
