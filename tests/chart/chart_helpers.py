"""Paths and the helm runner shared by the chart tests (a unique name: imported by path)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvpilot"
HELM = ROOT / ".tools" / "bin" / "helm"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs helm; gives the finished process (stdout, stderr, returncode)."""
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=60,
                          check=False)
