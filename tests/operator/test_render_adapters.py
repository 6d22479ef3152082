"""Where an InferenceModel's LoRA adapters end up in an engine pod, and the flags naming them.

The engine's LoRA flags come from the lora-engine work (the contract: `--enable-lora
--lora-modules name=path ... --max-loras N --max-lora-rank R`); until this checkout's engine
has them the operator refuses spec.adapters, so the rendering tests fake that the engine
has them (`lora_engine`), and one test checks the refusal itself.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from helpers.lora_engine import fake_lora_engine

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import DecodePoolSpec
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.adapters import engine_serves_lora
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool
from kvpilot.operator.weights.request import DEFAULT_EXCLUDE, DEFAULT_INCLUDE

IM = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
      "metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 1}}
ADAPTERS = [{"name": "sql", "source": "hf://org/sql-lora", "revision": "v2"},
            {"name": "law", "source": "pvc://loras/law"},
            {"name": "med", "source": "pvc://loras/med/v1"},
            {"name": "fin", "source": "oci://registry.example/fin-lora:1"}]


@pytest.fixture
def lora_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_lora_engine(monkeypatch)


def spec(adapters: list[dict[str, Any]] | None = ADAPTERS, **extra: Any) -> InferenceModelSpec:
    return InferenceModelSpec.model_validate({
        "model": {"name": "chat", "source": "hf://meta-llama/Llama-3.1-8B-Instruct",
                  "secretRef": {"name": "hf"}},
        "accelerator": {"vendor": "cpu"}, "adapters": adapters, **extra})


def pod(model_spec: InferenceModelSpec) -> dict[str, Any]:
    """Gives the engine pod spec of the InferenceModel's decode pool, schema-validated."""
    children = render_children(IM, model_spec, owned_pools(model_spec, "chat"), RenderConfig())
    stored = next(o for o in children if o["kind"] == "DecodePool")
    resolved = resolve_pool(DecodePoolSpec.model_validate(stored["spec"]), model_spec)
    objects = render_pool({**stored, "metadata": {**stored["metadata"], "uid": "p1"}}, resolved,
                          RenderConfig())
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    kubernetes_validate.validate(deployment, "1.33", strict=True)
    return deployment["spec"]["template"]["spec"]


def lora_flags(args: list[str]) -> list[str]:
    return args[args.index("--enable-lora"):]


def test_flags_name_each_adapter_directory(lora_engine: None):
    args = pod(spec())["containers"][0]["args"]
    assert lora_flags(args) == [
        "--enable-lora", "--lora-modules", "sql=/adapters/sql", "law=/adapter-claims/loras/law",
        "med=/adapter-claims/loras/med/v1", "fin=/adapter-images/fin/models", "--max-loras", "4"]


@pytest.mark.parametrize(("adapters", "engine", "expected"), [
    (ADAPTERS[:2], {}, ["--max-loras", "2"]),  # default: min(len(adapters), 4)
    ([*ADAPTERS, {"name": "gov", "source": "hf://org/gov"}], {}, ["--max-loras", "4"]),
    (ADAPTERS[:1], {"maxLoras": 3, "maxLoraRank": 64},
     ["--max-loras", "3", "--max-lora-rank", "64"]),
], ids=["two", "four-capped", "explicit"])
def test_max_loras(lora_engine: None, adapters: list[dict[str, Any]], engine: dict[str, Any],
                   expected: list[str]):
    args = pod(spec(adapters, engine=engine))["containers"][0]["args"]
    assert lora_flags(args)[-len(expected):] == expected


def test_volumes_mounts_and_init_containers(lora_engine: None):
    pod_spec = pod(spec())
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert volumes["adapters"] == {"name": "adapters", "emptyDir": {"sizeLimit": "2Gi"}}
    # one volume per claim, however many adapters it holds
    assert volumes["adapter-claim-0"]["persistentVolumeClaim"] == {"claimName": "loras",
                                                                   "readOnly": True}
    assert "adapter-claim-1" not in volumes
    assert volumes["adapter-fin"]["image"]["reference"] == "registry.example/fin-lora:1"
    mounts = {m["name"]: m for m in pod_spec["containers"][0]["volumeMounts"]}
    for name, path in (("adapters", "/adapters"), ("adapter-claim-0", "/adapter-claims/loras"),
                       ("adapter-fin", "/adapter-images/fin")):
        assert mounts[name] == {"name": name, "mountPath": path, "readOnly": True}
    init = {c["name"]: c for c in pod_spec["initContainers"]}
    assert set(init) == {"fetch-model", "fetch-adapter-sql"}
    fetch = init["fetch-adapter-sql"]
    assert fetch["command"] == ["kvpilot", "fetch", "org/sql-lora", "--revision", "v2",
                                "--include", *DEFAULT_INCLUDE, "--exclude", *DEFAULT_EXCLUDE,
                                "--local-dir", "/adapters/sql"]
    assert fetch["volumeMounts"][0] == {"name": "adapters", "mountPath": "/adapters"}
    # the base model's token (spec.model.secretRef) serves the adapters' downloads too
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}} \
        in fetch["env"]
    assert fetch["securityContext"] == init["fetch-model"]["securityContext"]


def test_without_adapters_nothing_changes(lora_engine: None):
    pod_spec = pod(spec(None))
    assert "--enable-lora" not in pod_spec["containers"][0]["args"]
    assert not [v for v in pod_spec["volumes"] if v["name"].startswith("adapter")]


def test_adapters_change_the_pods_hash(lora_engine: None):
    first = owned_pools(spec(ADAPTERS[:1]), "chat")[0].resolved.to_json()
    second = owned_pools(spec(ADAPTERS[:2]), "chat")[0].resolved.to_json()
    assert first["adapters"] != second["adapters"]
    assert "adapters" not in owned_pools(spec(None), "chat")[0].resolved.to_json()


@pytest.mark.parametrize("flag", ["--enable-lora", "--lora-modules", "--max-loras",
                                  "--max-lora-rank"])
def test_extra_args_may_not_set_lora_flags(flag: str):
    with pytest.raises(ValueError, match=f"extraArgs sets {flag}, which the operator renders"):
        pod(spec(None, engine={"extraArgs": [flag, "1"]}))


def test_refused_while_the_engine_has_no_lora():
    if engine_serves_lora():
        pytest.skip("this checkout's engine takes --enable-lora")
    with pytest.raises(ValueError, match=r"spec.adapters=\['sql'\]: this kvpilot's engine has no "
                                         "LoRA flags"):
        pod(spec(ADAPTERS[:1]))


def test_rendered_line_parses_with_the_engines_parser():
    """Once the engine has LoRA, its own parser takes the operator's serve line."""
    if not engine_serves_lora():
        pytest.skip("this checkout's engine has no --enable-lora yet (branch lora-engine)")
    from kvpilot.engine.contracts.args import EngineArgs, from_namespace
    from kvpilot.operator.render.engine_args import _serve_parser

    args = pod(spec())["containers"][0]["args"]
    parsed = from_namespace(EngineArgs, _serve_parser().parse_args(args))
    assert parsed.enable_lora and parsed.max_loras == 4  # type: ignore[attr-defined]


def test_the_engines_lora_limits_refuse_at_render():
    """Once the engine has LoRA, its own refusals (lora-engine: one GPU per replica) name
    spec.adapters when the operator renders."""
    if not engine_serves_lora():
        pytest.skip("this checkout's engine has no --enable-lora yet (branch lora-engine)")
    with pytest.raises(ValueError, match=r"spec\.adapters: kvpilot serve refuses LoRA"):
        pod(spec(ADAPTERS[:1], topology={"tensorParallel": 2}))
