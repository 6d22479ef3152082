"""Chart test fixtures: the real helm binary (skipped with a reason when absent) and rendering."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, HELM, run_helm


@pytest.fixture(scope="session")
def helm() -> Path:
    if not HELM.exists():
        pytest.skip(f"{HELM} is missing: run scripts/setup.sh (extracts helm and kubectl)")
    return HELM


@pytest.fixture(scope="session")
def render(helm: Path) -> Callable[..., list[dict[str, Any]]]:
    """Gives a function rendering the chart with values files/--set flags into objects."""
    cache: dict[tuple[str, ...], list[dict[str, Any]]] = {}

    def _render(*values: Path, sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        args = ["template", "kv", str(CHART), "--namespace", "kvpilot-system"]
        for path in values:
            args += ["-f", str(path)]
        for item in sets:
            args += ["--set", item]
        key = tuple(args)
        if key not in cache:
            done = run_helm(helm, *args)
            assert done.returncode == 0, done.stderr
            cache[key] = [d for d in yaml.safe_load_all(done.stdout) if d]
        return cache[key]

    return _render
