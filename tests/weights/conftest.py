"""Fixtures: a Hub stand-in on 127.0.0.1 (tests/weights/hub_standin.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
