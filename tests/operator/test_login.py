"""`kvpilot operator` logs in like kubectl (an exec plugin here), and without a cluster it says so.

The emulator accepts only the token the exec plugin prints, so reconciling proves both kopf
and the handlers' client used the plugin's credentials.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import kopf
import pytest
import yaml
from operator_harness import IMS, NAMESPACE, eventually

from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.errors import KubeError
from kvpilot.operator.kube.login import LoginError, kubeconfig_login
from kvpilot.operator.local.supervisor import free_port

OPERATOR = [sys.executable, "-m", "kvpilot.cli.main", "operator", "-n", NAMESPACE, "--dev",
            "--log-level", "warning"]


def exec_kubeconfig(tmp_path: Path, server: str, token: str, fail: bool = False,
                    expires: str | None = None) -> Path:
    """Writes a kubeconfig whose user is an exec plugin printing an ExecCredential with
    `token` (or failing); every run appends a line to tmp_path/plugin-runs."""
    plugin = tmp_path / "plugin.py"
    status = {"token": token, **({"expirationTimestamp": expires} if expires else {})}
    credential = {"apiVersion": "client.authentication.k8s.io/v1beta1", "kind": "ExecCredential",
                  "status": status}
    plugin.write_text(
        "import sys\n"
        f"open({str(tmp_path / 'plugin-runs')!r}, 'a').write('run\\n')\n"
        + ("sys.exit('plugin: not logged in to the identity provider')\n" if fail else "")
        + f"print({json.dumps(json.dumps(credential))})\n")
    path = tmp_path / "exec-kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "exec",
        "clusters": [{"name": "emu", "cluster": {"server": server}}],
        "users": [{"name": "exec", "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1", "command": sys.executable,
            "args": [str(plugin)], "interactiveMode": "Never"}}}],
        "contexts": [{"name": "exec", "context": {"cluster": "emu", "user": "exec"}}],
    }))
    return path


def one_line_failure(env: dict[str, str], code: int = 1) -> str:
    """Runs `kvpilot operator` expecting a quick exit `code`; gives its one stderr line."""
    start = time.monotonic()
    done = subprocess.run(OPERATOR, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stdout + done.stderr
    assert time.monotonic() - start < 30  # no retry loop
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith("kvpilot operator: ")
    return lines[0]


async def test_operator_logs_in_with_an_exec_plugin_and_reconciles(api, tmp_path: Path):
    api.tokens = {"exec-token"}
    env = {**os.environ, "KUBECONFIG": str(exec_kubeconfig(tmp_path, api.base_url, "exec-token"))}
    port = free_port()
    proc = subprocess.Popen([*OPERATOR, "--liveness", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=api.base_url,
                                     headers={"Authorization": "Bearer exec-token"}) as http:
            async def healthy() -> bool:
                try:
                    return (await http.get(f"http://127.0.0.1:{port}/healthz")).is_success
                except httpx.HTTPError:
                    return False

            await eventually(healthy, timeout=60, what="liveness endpoint")
            manifest = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceModel",
                        "metadata": {"name": "ex", "namespace": NAMESPACE},
                        "spec": {"model": {"name": "ex", "source": "dummy:tiny-llama"},
                                 "accelerator": {"vendor": "cpu"}}}
            r = await http.post(f"/apis/kvpilot.dev/v1alpha1/namespaces/{NAMESPACE}/"
                                "inferencemodels", json=manifest)
            assert r.status_code == 200, r.text
        await eventually(lambda: (api.get(IMS, NAMESPACE, "ex") or {}).get("status", {})
                         .get("observedGeneration") == 1, timeout=120, what="status")
        assert api.get("apps/v1/deployments", NAMESPACE, "ex-decode")
        assert (tmp_path / "plugin-runs").read_text().count("run") >= 1
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 30)
        assert code == 0, proc.stdout.read().decode()[-2000:] if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_without_a_cluster_the_operator_exits_1_with_one_line(tmp_path: Path):
    env = {**os.environ, "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    line = one_line_failure(env)
    assert "no cluster" in line and "KUBECONFIG" in line


@pytest.mark.parametrize("text", ["apiVersion: v1\nclusters: [\n  - {name: x\n", "- a\n- b\n",
                                  "just text\n"])
def test_a_malformed_kubeconfig_is_one_line_exit_2(tmp_path: Path, text: str):
    """It crashed with a YAML traceback (issue 49)."""
    path = tmp_path / "kubeconfig"
    path.write_text(text)
    line = one_line_failure({**os.environ, "KUBECONFIG": str(path)}, code=2)
    assert f"kubeconfig {path} is not a readable kubeconfig" in line and "fix the file" in line


def test_an_unreachable_server_or_a_failing_plugin_is_one_line(tmp_path: Path):
    server = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "KUBECONFIG": str(exec_kubeconfig(tmp_path, server, "t"))}
    assert f"cannot reach the API server at {server}" in one_line_failure(env)
    env["KUBECONFIG"] = str(exec_kubeconfig(tmp_path, server, "t", fail=True))
    assert "not logged in to the identity provider" in one_line_failure(env)


def test_the_kubeconfig_login_carries_the_plugins_expiry(tmp_path: Path):
    path = exec_kubeconfig(tmp_path, "https://example.invalid", "tok",
                           expires="2030-01-01T00:00:00Z")
    info = kubeconfig_login(str(path))
    assert (info.server, info.scheme, info.token) == ("https://example.invalid", "Bearer", "tok")
    assert info.expiration == datetime.datetime(2030, 1, 1, tzinfo=datetime.UTC)
    with pytest.raises(LoginError, match="no kubeconfig"):
        kubeconfig_login(str(tmp_path / "missing"))


async def test_the_client_logs_in_again_on_401(api):
    api.tokens = {"new"}
    logins: list[str] = []

    def relogin() -> kopf.ConnectionInfo:
        logins.append("new")
        return kopf.ConnectionInfo(server=api.base_url, token="new")

    stale = kopf.ConnectionInfo(server=api.base_url, token="old")
    without = Kube(stale)
    with pytest.raises(KubeError, match="HTTP 401"):
        await without.list("v1", "ConfigMap", NAMESPACE)
    await without.close()
    kube = Kube(stale, relogin=relogin)
    assert await kube.list("v1", "ConfigMap", NAMESPACE) == []
    assert await kube.list("v1", "ConfigMap", NAMESPACE) == []
    assert logins == ["new"]
    await kube.close()
