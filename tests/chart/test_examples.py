"""Every example manifest passes the CRD (schema + CEL), parses, plans, and renders through the
operator into objects valid for Kubernetes 1.34."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import ROOT

from kvpilot.operator.api import DecodePool, InferenceModel, PrefillPool

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
MODELS = {"InferenceModel": InferenceModel, "PrefillPool": PrefillPool, "DecodePool": DecodePool}
# LeaderWorkerSet is a CRD kind the 1.34 schemas do not know.
FOREIGN_KINDS = {"LeaderWorkerSet"}


def _crd_eval() -> Any:
    """Gives tests/operator_api/crd_eval.py (shared helper, loaded by path)."""
    path = ROOT / "tests" / "operator_api" / "crd_eval.py"
    spec = importlib.util.spec_from_file_location("crd_eval_for_chart", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _objects(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_four_documented_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"tiny-cpu.yaml", "llama-70b-tp8-h100.yaml", "disaggregated.yaml",
            "moe-mi300x-cpx.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_passes_the_api_server(path: Path):
    crd_eval = _crd_eval()
    crds = crd_eval.load_crds()
    for obj in _objects(path):
        assert crd_eval.api_server_errors(crds[obj["kind"]], obj) == []
        MODELS[obj["kind"]].model_validate(obj)


def _with_server_fields(obj: dict[str, Any]) -> dict[str, Any]:
    meta = {"namespace": "default", "uid": f"uid-{obj['metadata']['name']}", "generation": 1,
            **obj["metadata"]}
    return {**obj, "metadata": meta}


def _render(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Gives everything the operator would create for `obj`, pools expanded recursively."""
    from kvpilot.operator.planning.pool import resolve_pool
    from kvpilot.operator.render.children import owned_pools, render_children
    from kvpilot.operator.render.meta import RenderConfig
    from kvpilot.operator.render.pool import render_pool

    config = RenderConfig()
    obj = _with_server_fields(obj)
    if obj["kind"] == "InferenceModel":
        spec = InferenceModel.model_validate(obj).spec
        out = render_children(obj, spec, owned_pools(spec, obj["metadata"]["name"]), config)
        for child in [c for c in out if c["kind"] in ("PrefillPool", "DecodePool")]:
            pool = MODELS[child["kind"]].model_validate(child).spec
            out += render_pool(_with_server_fields(child), resolve_pool(pool, spec), config)
        return out
    pool = MODELS[obj["kind"]].model_validate(obj).spec
    return render_pool(obj, resolve_pool(pool, None), config)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_renders_valid_objects(path: Path):
    import kubernetes_validate

    crd_eval = _crd_eval()
    crds = crd_eval.load_crds()
    for obj in _objects(path):
        rendered = _render(obj)
        assert any(o["kind"] in ("Deployment", "StatefulSet") for o in rendered)
        for child in rendered:
            if child["kind"] in crds:
                assert crd_eval.api_server_errors(crds[child["kind"]], child) == []
            elif child["kind"] not in FOREIGN_KINDS:
                kubernetes_validate.validate(child, "1.34", strict=True)


@pytest.mark.parametrize(("path", "resource", "count"), [
    ("llama-70b-tp8-h100.yaml", "nvidia.com/gpu", "8"),
    ("moe-mi300x-cpx.yaml", "amd.com/cpx_nps4", "8"),
    ("disaggregated.yaml", "nvidia.com/gpu", "2"),
])
def test_gpu_examples_request_their_devices(path: str, resource: str, count: str):
    (obj,) = _objects(ROOT / "examples" / path)
    pods = [o["spec"]["template"]["spec"] for o in _render(obj)
            if o["kind"] in ("Deployment", "StatefulSet")]
    limits = [c["resources"].get("limits", {}) for p in pods for c in p["containers"]]
    assert any(str(lim.get(resource)) == count for lim in limits), limits


def test_tiny_cpu_plans_for_kvpilot_up():
    """The README's main manifest stays runnable by `kvpilot up` (planned, not started)."""
    from itertools import count

    from kvpilot.operator.local.plan import plan_local

    ports = count(20000)
    (obj,) = _objects(ROOT / "examples" / "tiny-cpu.yaml")
    engines, router = plan_local(obj, lambda: next(ports), 8080)
    assert len(engines) == 1 and router is not None
