"""The init container and Job commands the operator renders, run against a local Hub stand-in.

Each test renders an InferenceModel, takes the rendered container's command and environment
(HF_ENDPOINT comes from the spec's overrides.env, the token from the Secret the spec names),
maps the container's mounts to temporary directories and runs the command as a process:
what a kubelet would run, minus the container.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hub_standin import Hub, HubServer, Repo

from kvpilot.operator.api.inference_model import InferenceModelSpec
from kvpilot.operator.api.pools import DecodePoolSpec
from kvpilot.operator.planning.pool import resolve_pool
from kvpilot.operator.render.children import owned_pools, render_children
from kvpilot.operator.render.meta import RenderConfig
from kvpilot.operator.render.pool import render_pool
from kvpilot.operator.weights.request import read_marker

REPO = "acme/tiny-chat"
OLD, NEW = "a" * 40, "b" * 40
IM = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
      "metadata": {"name": "chat", "namespace": "ns", "uid": "u1", "generation": 1}}
BIN = Path(sys.executable).parent
BIG = bytes(range(256)) * 4 * 8 * 1024  # 8 MiB


def commit(tag: bytes, weights: bytes = b"") -> dict[str, bytes]:
    return {
        "model.safetensors": weights or b"weights-" + tag,
        "config.json": b'{"rev": "' + tag + b'"}',
        "tokenizer.json": b"{}",
        "generation_config.json": b"{}",
        "original/consolidated.00.pth": b"meta's copy " + tag,
        "original/params.json": b"{}",
        "consolidated.safetensors": b"mistral's copy " + tag,
        "README.md": b"# readme",
        "pytorch_model.bin": b"pickle " + tag,
    }


def hub(token: str | None = None, weights: bytes = b"") -> Hub:
    return Hub({REPO: Repo({OLD: commit(b"old", weights), NEW: commit(b"new")},
                           {"main": NEW, "v1": OLD}, token)})


def model_spec(url: str, **model: Any) -> InferenceModelSpec:
    return InferenceModelSpec.model_validate({
        "model": {"name": "chat", "source": f"hf://{REPO}", **model},
        "accelerator": {"vendor": "cpu"}, "overrides": {"env": {"HF_ENDPOINT": url}}})


def engine_pod(spec: InferenceModelSpec) -> dict[str, Any]:
    stored = next(o for o in render_children(IM, spec, owned_pools(spec, "chat"), RenderConfig())
                  if o["kind"] == "DecodePool")
    resolved = resolve_pool(DecodePoolSpec.model_validate(stored["spec"]), spec)
    objects = render_pool({**stored, "metadata": {**stored["metadata"], "uid": "p"}}, resolved,
                          RenderConfig())
    return next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]


def cache_job_pod(spec: InferenceModelSpec) -> dict[str, Any]:
    objects = render_children(IM, spec, owned_pools(spec, "chat"), RenderConfig())
    return next(o for o in objects if o["kind"] == "Job")["spec"]["template"]["spec"]


def start(container: dict[str, Any], volumes: dict[str, Path],
          secrets: dict[tuple[str, str], str] | None = None) -> subprocess.Popen[str]:
    """Starts a rendered container's command as a process: mount paths mapped to `volumes`
    (by volume name), secretKeyRef values from `secrets`."""
    paths = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}

    def local(text: str) -> str:
        for mount, path in paths.items():
            if text == mount or text.startswith(mount + "/"):
                return str(path) + text[len(mount):]
        return text

    env = {"PATH": f"{BIN}:{os.environ['PATH']}", "HOME": str(volumes["tmp"])}
    for item in container["env"]:
        if "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = (secrets or {})[(ref["name"], ref["key"])]
        else:
            env[item["name"]] = local(item["value"])
    command = [local(arg) for arg in container["command"]]
    assert command[0] == "kvpilot" and (BIN / "kvpilot").exists()
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def run(container: dict[str, Any], volumes: dict[str, Path],
        secrets: dict[tuple[str, str], str] | None = None) -> tuple[int, str, str]:
    proc = start(container, volumes, secrets)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def dirs(tmp_path: Path, name: str = "pod") -> dict[str, Path]:
    out = {"model": tmp_path / "weights", "tmp": tmp_path / name / "tmp"}
    for path in out.values():
        path.mkdir(parents=True, exist_ok=True)
    return out


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if p.is_file() and not str(p.relative_to(root)).startswith(".")}


def test_filters_are_honoured_and_the_revision_is_pinned(tmp_path: Path):
    state = hub()
    with HubServer(state) as url:
        init = engine_pod(model_spec(url, revision="v1"))["initContainers"][0]
        code, out, err = run(init, dirs(tmp_path))
    assert code == 0, out + err
    root = tmp_path / "weights"
    assert files(root) == {"model.safetensors", "config.json", "tokenizer.json",
                           "generation_config.json"}
    assert (root / "model.safetensors").read_bytes() == b"weights-old"  # v1, not main
    assert (root / "config.json").read_bytes() == b'{"rev": "old"}'
    fetched = {r.path.split("/resolve/")[1] for r in state.downloads()}
    assert all(f.startswith(OLD + "/") for f in fetched), fetched  # every file at one commit
    assert not any(name in f for f in fetched
                   for name in ("original/", "README", "pytorch_model", "consolidated"))
    marker = read_marker(root)
    assert marker is not None and (marker.commit, marker.files) == (OLD, 4)
    assert f"is commit {OLD}" in out and out.rstrip().endswith("100% (" + str(marker.bytes)
                                                               + " of " + str(marker.bytes)
                                                               + " bytes)")


def test_a_second_replica_finds_the_files_and_downloads_nothing(tmp_path: Path):
    state = hub()
    with HubServer(state) as url:
        init = engine_pod(model_spec(url))["initContainers"][0]
        assert run(init, dirs(tmp_path, "first"))[0] == 0
        served = len(state.log)
        code, out, err = run(init, dirs(tmp_path, "second"))
    assert code == 0, out + err
    assert len(state.log) == served  # not even a metadata call
    assert "nothing to download" in out
    assert (tmp_path / "weights" / "model.safetensors").read_bytes() == b"weights-new"


def test_the_cache_job_fills_the_claim_once_and_engine_pods_only_wait(tmp_path: Path):
    state = hub()
    with HubServer(state) as url:
        spec = model_spec(url, revision=OLD, cache={"size": "1Gi"})
        job = cache_job_pod(spec)["containers"][0]
        wait = engine_pod(spec)["initContainers"][0]
        # scheduled before the Job finished; polling every 0.5 s through `kvpilot fetch`'s
        # --interval, not the rendered command's default 10 s
        polling = {**wait, "command": [*wait["command"], "--interval", "0.5"]}
        waiting = start(polling, dirs(tmp_path, "engine-0"))
        time.sleep(0.5)
        assert waiting.poll() is None
        code, out, err = run(job, dirs(tmp_path, "job"))
        assert code == 0, out + err
        served = len(state.log)
        assert waiting.wait(timeout=60) == 0
        for replica in range(2):  # replicas and restarts after the fill: no wait, no download
            code, out, err = run(wait, dirs(tmp_path, f"engine-{replica + 1}"))
            assert code == 0 and f"is in {tmp_path / 'weights'}" in out, out + err
    assert len(state.log) == served


def test_an_interrupted_download_resumes(tmp_path: Path):
    state = hub(weights=BIG)
    state.chunk_delay = 0.03  # 128 chunks of 64 KiB: about 4 s for the big file
    with HubServer(state) as url:
        init = engine_pod(model_spec(url, revision=OLD))["initContainers"][0]
        volumes = dirs(tmp_path)
        proc = start(init, volumes)
        partial = volumes["model"] / ".kvpilot" / "partial"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            parts = list(partial.glob("model.safetensors.*.part")) if partial.exists() else []
            if parts and parts[0].stat().st_size >= 2**20:
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        else:
            raise AssertionError("no partial download appeared within 60 s")
        proc.send_signal(signal.SIGKILL)  # a node lost, an OOM kill: no clean-up runs
        proc.wait(timeout=30)
        assert not (volumes["model"] / "model.safetensors").exists()
        state.chunk_delay = 0.0
        code, out, err = run(init, volumes)
    assert code == 0, out + err
    assert (volumes["model"] / "model.safetensors").read_bytes() == BIG
    ranges = [r.range for r in state.downloads() if r.path.endswith("/model.safetensors")]
    assert ranges[0] is None and ranges[-1] is not None, ranges
    resumed_at = int(ranges[-1].removeprefix("bytes=").split("-")[0])
    assert 2**20 <= resumed_at < len(BIG)


def test_a_gated_model_needs_the_secret_and_says_so(tmp_path: Path):
    state = hub(token="hf_secret")
    with HubServer(state) as url:
        bare = engine_pod(model_spec(url))["initContainers"][0]
        code, out, err = run(bare, dirs(tmp_path, "bare"))
        assert code == 2  # only a spec change helps: the Job's podFailurePolicy stops there
        assert err.strip().splitlines()[-1] == (
            f"kvpilot fetch: error: {REPO} is gated: set spec.model.secretRef to a Secret whose "
            "HF_TOKEN has been granted access")
        init = engine_pod(model_spec(url, secretRef={"name": "hf"}))["initContainers"][0]
        code, out, err = run(init, dirs(tmp_path, "token"), {("hf", "HF_TOKEN"): "hf_secret"})
    assert code == 0, out + err
    assert {r.auth for r in state.log[-3:]} == {"Bearer hf_secret"}


@pytest.mark.parametrize(("model", "message"), [
    ({"revision": "no-such-branch"},
     "spec.model.revision='no-such-branch' is not a branch, tag or commit of acme/tiny-chat"),
    ({"include": ["*.gguf"]}, "matches include=['*.gguf']"),
])
def test_a_wrong_revision_or_filter_names_the_field(tmp_path: Path, model, message):
    with HubServer(hub()) as url:
        init = engine_pod(model_spec(url, **model))["initContainers"][0]
        code, _, err = run(init, dirs(tmp_path))
    assert code == 2 and message in err.strip().splitlines()[-1], err


def test_an_unreachable_hub_is_worth_another_attempt(tmp_path: Path):
    server = HubServer(hub())
    with server as url:
        init = engine_pod(model_spec(url))["initContainers"][0]
    code, _, err = run(init, dirs(tmp_path))  # the stand-in is gone: connection refused
    assert code == 1, err
    assert "the next attempt starts over from what is on disk" in err
