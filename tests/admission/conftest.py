"""The admission tables reuse the CRD evaluator (tests/operator_api) by import path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "operator_api"))
