"""The hardening check over every rendered pod of every example and render-matrix case
(engines, routers, weights init containers and Jobs): non-root, no privilege escalation, all
capabilities dropped (IPC_LOCK only with RDMA), read-only root filesystem, size-limited
emptyDirs, no service-account token (the router container alone gets its projected one),
requests and limits set with requests <= limits, the fleet Secret mounted read-only in
engines and routers; and every rendered object valid for Kubernetes 1.34."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from test_render_matrix import CASES, K8S_VERSION, render_all

from kvpilot.engine.contracts.fleet_secret import FLEET_SECRET_PATH
from kvpilot.operator.api.formats import parse_quantity
from kvpilot.operator.api.pools import SPEC_BY_KIND
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.fleet import FLEET_SECRET_DIR
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool
from kvpilot.operator.render.router import TOKEN_DIR

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_objects(path: Path) -> list[dict[str, Any]]:
    manifest = yaml.safe_load(path.read_text())
    if manifest["kind"] == "InferenceModel":
        return render_all(manifest["spec"], RenderConfig())
    pool = {**manifest, "metadata": {**manifest["metadata"], "namespace": "ns", "uid": "u"}}
    spec = SPEC_BY_KIND[manifest["kind"]].model_validate(manifest["spec"])
    return render_pool(pool, resolve_pool(spec, None), RenderConfig())


RENDERED = {f"example-{p.stem}": (lambda p=p: example_objects(p))
            for p in sorted(EXAMPLES.glob("*.yaml"))}
RENDERED.update({f"matrix-{c[0]}": (lambda c=c: render_all(c[1], c[2])) for c in CASES})


def pod_templates(objects: list[dict[str, Any]],
                  kinds: tuple[str, ...] = ("Deployment", "StatefulSet", "LeaderWorkerSet", "Job"),
                  ) -> list[dict[str, Any]]:
    out = []
    for obj in objects:
        spec = obj.get("spec") or {}
        template = spec.get("template") or spec.get("leaderWorkerTemplate", {}).get(
            "workerTemplate")
        if template is not None and obj["kind"] in kinds:
            out.append(template)
    return out


def check_container(container: dict[str, Any], rdma: bool) -> None:
    name = container["name"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False, name
    assert security["readOnlyRootFilesystem"] is True, name
    assert security["capabilities"]["drop"] == ["ALL"], name
    assert set(security["capabilities"].get("add", [])) == ({"IPC_LOCK"} if rdma else set()), name
    resources = container["resources"]
    assert "memory" in resources["limits"] and resources["requests"], name
    for key, request in resources["requests"].items():
        if key in resources["limits"]:
            assert parse_quantity(request) <= parse_quantity(resources["limits"][key]), key
    for mount in container.get("volumeMounts", []):
        assert not mount["mountPath"].startswith(TOKEN_DIR) or name == "router", name


def check_pod(template: dict[str, Any], fleet: bool = True) -> None:
    pod = template["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for volume in pod.get("volumes", []):
        if "emptyDir" in volume:
            assert volume["emptyDir"].get("sizeLimit"), volume["name"]
    rdma = any(c["securityContext"]["capabilities"].get("add") for c in pod["containers"])
    main = pod["containers"][0]
    assert rdma == ("rdma/rdma_shared_device_a" in main["resources"]["limits"])
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        check_container(container, rdma and container is main)
    if not fleet:  # a weights Job: no fleet to talk to
        return
    mounts = [m for m in main["volumeMounts"] if m["mountPath"] == FLEET_SECRET_DIR]
    assert mounts and mounts[0]["readOnly"] is True
    assert main["args"][main["args"].index("--fleet-secret-file") + 1] == FLEET_SECRET_PATH


@pytest.mark.parametrize("case", sorted(RENDERED))
def test_every_rendered_pod_is_hardened(case: str):
    objects = RENDERED[case]()
    assert pod_templates(objects)
    for template in pod_templates(objects, ("Deployment", "StatefulSet", "LeaderWorkerSet")):
        check_pod(template)
    for template in pod_templates(objects, ("Job",)):
        check_pod(template, fleet=False)
    for obj in objects:
        if obj["kind"] not in SPEC_BY_KIND and obj["kind"] != "LeaderWorkerSet":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_check_catches_a_writable_root_filesystem():
    objects = RENDERED["example-tiny-cpu"]()
    template = pod_templates(objects)[0]
    template["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] = False
    with pytest.raises(AssertionError):
        check_pod(template)


def test_the_cases_cover_weights_downloads():
    """The hardening check above sees a weights Job and the engines' download init container."""
    objects = [o for case in sorted(RENDERED) for o in RENDERED[case]()]
    assert pod_templates(objects, ("Job",))
    assert any(t["spec"].get("initContainers") for t in pod_templates(objects))
