"""`kvpilot up`'s plan: the operator's rendered pods as local processes, table-tested."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import yaml

from kvpilot.operator.local.plan import _set_flag, plan_local

TINY = yaml.safe_load((Path(__file__).parents[2] / "examples" / "tiny-cpu.yaml").read_text())


def manifest(**spec_changes) -> dict:
    out = copy.deepcopy(TINY)
    out["spec"].update(spec_changes)
    return out


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize(("changes", "roles", "instances"), [
    ({}, ["both"], "both=http://127.0.0.1:9000"),
    ({"decode": {"replicas": 3}}, ["both"] * 3,
     "both=http://127.0.0.1:9000,both=http://127.0.0.1:9001,both=http://127.0.0.1:9002"),
    ({"servingMode": "disaggregated", "prefill": {"replicas": 1}, "decode": {"replicas": 2}},
     ["prefill", "decode", "decode"],
     "prefill=http://127.0.0.1:9000,decode=http://127.0.0.1:9001,decode=http://127.0.0.1:9002"),
])
def test_plan_table(changes, roles, instances):
    ports = itertools.count(9000)
    engines, router = plan_local(manifest(**changes), lambda: next(ports), 8080)
    assert [e.role for e in engines] == roles
    for engine in engines:
        # the pod's own command line, only host and port rewritten
        assert engine.argv[3:5] == ["serve", "--model"]
        assert (flag(engine.argv, "--host"), flag(engine.argv, "--port")) == (
            "127.0.0.1", str(engine.port))
        assert flag(engine.argv, "--role") == (None if engine.role == "both" else engine.role)
        assert flag(engine.argv, "--kv-cache-memory") == "64MiB"
        assert engine.env["POD_IP"] == "127.0.0.1"
    assert router.argv[3] == "route"
    assert flag(router.argv, "--instances") == instances
    assert flag(router.argv, "--discovery") == "static"
    assert flag(router.argv, "--selector") is None
    assert flag(router.argv, "--tokenizer") == "tiny-llama"
    assert (flag(router.argv, "--host"), flag(router.argv, "--port")) == ("127.0.0.1", "8080")


@pytest.mark.parametrize(("bad", "error"), [
    ({"kind": "DecodePool"}, "kind='DecodePool' is not supported"),
    ({"spec": {**TINY["spec"], "router": {"replicas": 0}}}, "spec.router.replicas=0"),
    ({"spec": {**TINY["spec"], "servingMode": "sideways"}}, "servingMode"),
])
def test_plan_errors_name_the_field(bad, error):
    with pytest.raises(ValueError, match=error):
        plan_local({**TINY, **bad}, lambda: 9000, 8080)


@pytest.mark.parametrize(("args", "flag_name", "value", "expected"), [
    (["a", "--port", "1", "b"], "--port", "2", ["a", "b", "--port", "2"]),
    (["--port=1", "b"], "--port", "2", ["b", "--port", "2"]),
    (["a", "--selector", "x"], "--selector", None, ["a"]),
    (["a"], "--host", "h", ["a", "--host", "h"]),
])
def test_set_flag(args, flag_name, value, expected):
    assert _set_flag(args, flag_name, value) == expected


def test_kvpilot_up_and_the_kv_wire_format_leave_torch_out():
    import subprocess
    import sys

    code = ("import sys; import kvpilot.operator.local.cli, kvpilot.operator.local.plan, "
            "kvpilot.operator.local.supervisor, kvpilot.engine.contracts.kv_protocol, "
            "kvpilot.engine.kv_transfer.tcp; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_process_reads_the_fleet_secret_kvpilot_up_wrote():
    ports = itertools.count(9000)
    disaggregated = manifest(servingMode="disaggregated", prefill={"replicas": 1},
                             decode={"replicas": 1})
    engines, router = plan_local(disaggregated, lambda: next(ports), 8080,
                                 fleet_secret_file="/tmp/up-secret")
    for process in [*engines, router]:
        # a pod's mounted path (rendered by the operator) is replaced, never doubled
        assert process.argv.count("--fleet-secret-file") == 1
        assert flag(process.argv, "--fleet-secret-file") == "/tmp/up-secret"


def test_without_a_secret_file_no_process_reads_the_pods_path():
    ports = itertools.count(9000)
    engines, router = plan_local(manifest(), lambda: next(ports), 8080)
    for process in [*engines, router]:
        assert "--fleet-secret-file" not in process.argv


@pytest.mark.parametrize(("key", "error"), [
    ("", "export KVPILOT_API_KEY"), ("k3y", None)])
def test_an_api_key_secret_needs_the_key_in_the_environment(monkeypatch, key, error):
    from kvpilot.operator.local.cli import check_api_key

    monkeypatch.setenv("KVPILOT_API_KEY", key)
    with_auth = manifest(auth={"apiKeySecretRef": {"name": "keys", "key": "api"}})
    check_api_key(manifest())  # no auth: nothing asked
    if error is None:
        check_api_key(with_auth)
        return
    with pytest.raises(ValueError, match=error) as caught:
        check_api_key(with_auth)
    assert "spec.auth.apiKeySecretRef" in str(caught.value)


def test_the_fleet_secret_file_is_private_and_loads(tmp_path):
    import os
    import stat

    from kvpilot.engine.contracts.fleet_secret import FleetSecret
    from kvpilot.operator.local.cli import write_fleet_secret

    path = write_fleet_secret()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert FleetSecret.from_file(str(path)).enabled
        other = write_fleet_secret()
        assert FleetSecret.from_file(str(path)) != FleetSecret.from_file(str(other))
        other.unlink()
    finally:
        path.unlink()


def test_adapters_are_refused_locally(monkeypatch):
    from helpers.lora_engine import fake_lora_engine

    fake_lora_engine(monkeypatch)
    with_adapters = manifest(adapters=[{"name": "sql", "source": "hf://org/sql"}])
    with pytest.raises(ValueError, match=r"spec\.adapters: kvpilot up runs no init containers"):
        plan_local(with_adapters, lambda: 9000, 8080)


def hub_model(**fields) -> dict:
    return {"name": "tiny-llama", "source": "hf://org/tiny", **fields}


@pytest.mark.parametrize(("model", "error"), [
    # an hf:// source: the exact kvpilot fetch line (revision and filters only when set)
    (hub_model(), "run `kvpilot fetch org/tiny --local-dir DIR`, then add --model-dir DIR"),
    (hub_model(revision="v2", include=["*.safetensors", "*.json"]),
     "run `kvpilot fetch org/tiny --revision v2 --include '*.safetensors' '*.json' "
     "--local-dir DIR`, then add --model-dir DIR"),
    ({"name": "tiny-llama", "source": "pvc://weights/tiny"},
     "mounts no PersistentVolumeClaim: copy the weights on the claim's path to a directory DIR, "
     "then add --model-dir DIR"),
    ({"name": "tiny-llama", "source": "oci://registry/tiny:1"},
     "pulls no image volume: copy the image's /models directory to a directory DIR, then add "
     "--model-dir DIR"),
])
def test_a_source_kvpilot_up_cannot_reach_is_refused_with_the_fix(model, error):
    with pytest.raises(ValueError) as caught:
        plan_local(manifest(model=model), lambda: 9000, 8080)
    assert str(caught.value).startswith(f"spec.model.source={model['source']!r}: ")
    assert error in str(caught.value)


def test_model_dir_serves_the_weights_from_there_in_every_engine():
    ports = itertools.count(9000)
    disaggregated = manifest(model=hub_model(), servingMode="disaggregated",
                             prefill={"replicas": 1}, decode={"replicas": 2})
    engines, router = plan_local(disaggregated, lambda: next(ports), 8080,
                                 model_dir="/data/tiny")
    assert len(engines) == 3
    for engine in engines:
        assert engine.argv.count("--model") == 1 and flag(engine.argv, "--model") == "/data/tiny"
    assert "--model" not in router.argv


def test_model_dir_is_refused_for_a_built_in_config():
    with pytest.raises(ValueError, match=r"--model-dir /data/tiny: spec\.model\.source="
                                         r"'dummy:tiny-llama' is a built-in config"):
        plan_local(manifest(), lambda: 9000, 8080, model_dir="/data/tiny")


def test_the_scaling_hint_never_says_to_edit_a_tracked_example(tmp_path, monkeypatch):
    """It said "edit the pools' replicas in examples/tiny-cpu.yaml" (issue 49)."""
    from kvpilot.operator.local.cli import DEFAULT_MANIFEST, scale_hint

    monkeypatch.chdir(DEFAULT_MANIFEST.parents[1])
    for example in (str(DEFAULT_MANIFEST), "examples/tiny-disagg-cpu.yaml"):
        hint = scale_hint(example, 42)
        assert f"is a tracked example: copy it (cp {example} my-" in hint, hint
        assert "edit the pools' replicas in" not in hint
    copy = str(tmp_path / "fleet.yaml")
    assert scale_hint(copy, 42) == f"  scale: edit the pools' replicas in {copy}, then: kill -HUP 42"
