"""scripts/build-images.sh: the commands it runs (dry run: no docker daemon here) and the Helm
values it prints, rendered with the real chart."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import ROOT, run_helm

SCRIPT = ROOT / "scripts" / "build-images.sh"
REGISTRY = "registry.example.com/ml"


def build(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=60, check=False, cwd=ROOT)


def commands(out: str) -> list[str]:
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")]


def test_dry_run_builds_from_the_repository_and_pushes_to_the_named_registry(tmp_path: Path):
    done = build("--registry", f"{REGISTRY}/", "--tag", "v1", "--dry-run",
                 "--values-file", str(tmp_path / "images.yaml"))
    assert done.returncode == 0, done.stderr
    assert commands(done.stdout) == [
        f"docker build --platform linux/amd64 -f images/operator.Dockerfile -t "
        f"{REGISTRY}/operator:v1 .",
        f"docker build --platform linux/amd64 -f images/engine-cuda.Dockerfile -t "
        f"{REGISTRY}/engine:v1 .",
        f"docker build --platform linux/amd64 -f images/engine-rocm.Dockerfile -t "
        f"{REGISTRY}/engine-rocm:v1 .",
        f"docker push {REGISTRY}/operator:v1",
        f"docker push {REGISTRY}/engine:v1",
        f"docker push {REGISTRY}/engine-rocm:v1",
    ]
    for command in commands(done.stdout)[:3]:  # every Dockerfile named exists
        assert (ROOT / command.split(" -f ")[1].split()[0]).is_file()
    assert yaml.safe_load((tmp_path / "images.yaml").read_text()) == {
        "image": {"repository": f"{REGISTRY}/operator", "tag": "v1"},
        "operator": {"engineImage": f"{REGISTRY}/engine:v1"}}
    assert "engine-rocm:v1" in (tmp_path / "images.yaml").read_text()  # the AMD hint


def test_no_push_and_a_subset(tmp_path: Path):
    done = build("--registry", REGISTRY, "--tag", "v2", "--images", "operator", "--no-push",
                 "--builder", "podman", "--dry-run", "--values-file", str(tmp_path / "v.yaml"))
    assert done.returncode == 0, done.stderr
    assert commands(done.stdout) == [f"podman build --platform linux/amd64 -f "
                                     f"images/operator.Dockerfile -t {REGISTRY}/operator:v2 ."]
    assert yaml.safe_load((tmp_path / "v.yaml").read_text()) == {
        "image": {"repository": f"{REGISTRY}/operator", "tag": "v2"}}


def test_the_default_tag_is_the_checkout_commit():
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT, check=True).stdout.strip()
    done = build("--registry", REGISTRY, "--images", "operator", "--dry-run")
    assert f"{REGISTRY}/operator:{head}" in done.stdout  # -dirty follows on a changed tree


@pytest.mark.parametrize(("args", "message"), [
    ((), "--registry is required"),
    (("--registry", REGISTRY, "--images", "operator,gpu"), "unknown image gpu"),
    (("--registry", REGISTRY, "--tag", "bad tag"), "is not a valid image tag"),
    (("--registry", REGISTRY, "--surprise"), "unknown argument --surprise"),
])
def test_mistakes_are_named(args: tuple[str, ...], message: str):
    done = build(*args, "--dry-run")
    assert done.returncode == 2 and message in done.stderr


def test_the_printed_values_point_the_chart_at_the_images(
        tmp_path: Path, render: Callable[..., list[dict[str, Any]]]):
    values = tmp_path / "images.yaml"
    assert build("--registry", REGISTRY, "--tag", "v3", "--dry-run",
                 "--values-file", str(values)).returncode == 0
    deployment = next(o for o in render(values) if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"{REGISTRY}/operator:v3"
    assert f"--engine-image={REGISTRY}/engine:v3" in container["args"]
    assert f"--router-image={REGISTRY}/operator:v3" in container["args"]


def test_notes_warn_about_the_unpublished_default_images(helm: Path, tmp_path: Path):
    def notes(*args: str) -> str:
        done = run_helm(helm, "install", "kv", str(ROOT / "charts" / "kvpilot"), "--dry-run",
                        *args)
        assert done.returncode == 0, done.stderr
        return done.stdout.split("NOTES:", 1)[1]

    assert "which nobody publishes" in notes()
    values = tmp_path / "images.yaml"
    build("--registry", REGISTRY, "--tag", "v4", "--dry-run", "--values-file", str(values))
    assert "nobody publishes" not in notes("-f", str(values))
