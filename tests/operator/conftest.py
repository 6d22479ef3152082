"""Fixtures: a kmock API server with kvpilot's CRDs, a kubeconfig for it, and the real operator."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from kube_fixtures import api, client, operator  # noqa: F401  (fixtures, found by name)
