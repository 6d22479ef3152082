"""The running kvpilot's version, as `GET /version` answers it (vLLM's route) on engines and
routers alike."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kvpilot_version() -> str:
    """Gives the installed `kvpilot` distribution's version ("unknown" from a bare checkout)."""
    try:
        return version("kvpilot")
    except PackageNotFoundError:
        return "unknown"
