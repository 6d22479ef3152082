"""What `kvpilot up` runs: the operator's own rendered pods, rewritten to local processes.

Pure: a manifest in, a list of processes out. Each pool's Deployment becomes
`replicas` engine processes with the container's command, args and env, the
host and ports rewritten to free 127.0.0.1 ports; the router Deployment
becomes one router process whose Kubernetes discovery is rewritten to the
static list of those engines (or to a file of them, which `kvpilot up`
rewrites when it scales). Nothing else differs from what a pod runs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.api.pools import SPEC_BY_KIND
from kvpilot.operator.local.weights import local_model_dir
from kvpilot.operator.render.children import OwnedPool, render_model
from kvpilot.operator.render.meta import COMPONENT_LABEL, RenderConfig
from kvpilot.operator.render.pool import render_pool

LOCALHOST = "127.0.0.1"
# Flags whose values a local process gets instead of the pod's.
ROUTER_DROPPED = ("--discovery", "--namespace", "--selector", "--port-name", "--host", "--port",
                  "--instances", "--instances-file", "--fleet-secret-file")


@dataclass
class LocalProcess:
    """One process of the local fleet."""

    name: str
    role: str  # both | prefill | decode | router
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    pool: str = ""  # the Deployment whose replica this is (engines only)

    @property
    def url(self) -> str:
        return f"http://{LOCALHOST}:{self.port}"


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]["containers"][0]


def _set_flag(args: list[str], flag: str, value: str | None) -> list[str]:
    """Gives args with `flag`'s value replaced (or removed when value is None)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == flag:
            skip = True
            continue
        if arg.startswith(flag + "="):
            continue
        out.append(arg)
    return out if value is None else [*out, flag, value]


def _command(container: dict[str, Any]) -> list[str]:
    """Gives the container's command as a local argv (`kvpilot` from this interpreter)."""
    command = list(container.get("command") or [])
    if command and command[0] == "kvpilot":
        command = [sys.executable, "-m", "kvpilot.cli.main", *command[1:]]
    return [*command, *container.get("args", [])]


def _env(container: dict[str, Any], name: str) -> dict[str, str]:
    """Gives the container's env as plain values; pod fields resolve to local stand-ins."""
    fields = {"status.podIP": LOCALHOST, "metadata.name": name, "metadata.namespace": "default",
              "spec.nodeName": "localhost"}
    out: dict[str, str] = {}
    for item in container.get("env") or []:
        if "value" in item:
            out[item["name"]] = str(item["value"])
        elif ref := (item.get("valueFrom") or {}).get("fieldRef"):
            out[item["name"]] = fields.get(ref.get("fieldPath", ""), "")
    return out


def manifest_objects(manifest: dict[str, Any], config: RenderConfig) -> tuple[
        list[OwnedPool], list[dict[str, Any]]]:
    """Gives the manifest's pools, resolved, and the objects the operator renders for it."""
    if manifest.get("kind") != "InferenceModel":
        raise ValueError(f"kind={manifest.get('kind')!r} is not supported by kvpilot up: "
                         "pass an InferenceModel manifest")
    meta = manifest.get("metadata") or {}
    im = {"apiVersion": manifest.get("apiVersion", "kvpilot.dev/v1alpha1"),
          "kind": "InferenceModel",
          "metadata": {"name": meta.get("name", "local"), "namespace": "default",
                       "uid": "local", "generation": 1}}
    rendered = render_model(im, manifest.get("spec") or {}, config)
    return rendered.pools, rendered.children


def instances_text(engines: list[LocalProcess]) -> str:
    """Gives the router's instance list ('ROLE=URL,...') of these engines."""
    return ",".join(f"{e.role}={e.url}" for e in engines)


def plan_local(manifest: dict[str, Any], free_port: Callable[[], int], router_port: int,
               config: RenderConfig | None = None, instances_file: str | None = None,
               fleet_secret_file: str | None = None, model_dir: str | None = None,
               ) -> tuple[list[LocalProcess], LocalProcess]:
    """Gives (engine processes, router process) running the manifest's fleet on this machine.

    With `instances_file` the router reads its engines from that file (which the
    caller writes and may rewrite to scale) instead of a fixed `--instances`. With
    `fleet_secret_file` every process reads the fleet secret from there (in a pod:
    the mounted Secret). With `model_dir` every engine serves the weights from there (a
    source other than `dummy:` needs it: see local/weights.py).
    """
    config = config or RenderConfig()
    pools, children = manifest_objects(manifest, config)
    resolved = {pool.name: pool.resolved for pool in pools}
    weights = local_model_dir(pools[0].resolved.model, model_dir)
    if any(pool.resolved.adapters for pool in pools):
        raise ValueError("spec.adapters: kvpilot up runs no init containers, so adapters "
                         "(downloaded or mounted into pods under /adapters*) are not there: "
                         "remove spec.adapters to run the fleet locally")
    engines: list[LocalProcess] = []
    for pool in (o for o in children if o["kind"] in SPEC_BY_KIND):
        # The API server would give the pool a uid; its children's owner references need one.
        pool = {**pool, "metadata": {**pool["metadata"], "uid": "local"}}
        pool_spec = resolved[pool["metadata"]["name"]]
        for workload in render_pool(pool, pool_spec, config):
            if workload["kind"] in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
                continue
            if workload["kind"] != "Deployment":
                raise ValueError(
                    f"pool {pool['metadata']['name']} needs a {workload['kind']} (a replica "
                    "spans several nodes): kvpilot up runs one-node replicas only; lower "
                    "spec.*.topology.tensorParallel/pipelineParallel")
            container = _container(workload)
            role = pool_spec.role
            for replica in range(workload["spec"].get("replicas", 1)):
                name = f"{workload['metadata']['name']}-{replica}"
                port = free_port()
                argv = _set_flag(_set_flag(_command(container), "--host", LOCALHOST),
                                 "--port", str(port))
                # The pods' fleet Secret is a file only on Kubernetes: the local fleet's own
                # file, else none.
                argv = _set_flag(argv, "--fleet-secret-file", fleet_secret_file)
                if weights is not None:  # the pod's /models/... is a volume it mounts
                    argv = _set_flag(argv, "--model", weights)
                engines.append(LocalProcess(name, role, argv, _env(container, name), port,
                                            workload["metadata"]["name"]))
    routers = [o for o in children if o["kind"] == "Deployment"
               and o["metadata"]["labels"].get(COMPONENT_LABEL) == "router"]
    if not routers:
        raise ValueError("spec.router.replicas=0 renders no router: kvpilot up needs one; "
                         "set spec.router.replicas to 1")
    container = _container(routers[0])
    argv = _command(container)
    for flag in ROUTER_DROPPED:
        argv = _set_flag(argv, flag, None)
    source = (["--instances-file", instances_file] if instances_file
              else ["--instances", instances_text(engines)])
    argv += ["--host", LOCALHOST, "--port", str(router_port), "--discovery", "static", *source]
    if fleet_secret_file:
        argv = _set_flag(argv, "--fleet-secret-file", fleet_secret_file)
    router = LocalProcess(routers[0]["metadata"]["name"], "router", argv,
                          _env(container, routers[0]["metadata"]["name"]), router_port)
    return engines, router
