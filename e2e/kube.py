"""kubectl helpers shared by the e2e fixtures and tests."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def kubectl_path() -> str | None:
    """Gives the kubectl binary to use."""
    local = REPO / ".tools" / "bin" / "kubectl"
    return str(local) if local.exists() else shutil.which("kubectl")


def kubectl(*args: str, namespace: str | None = None, check: bool = True,
            input_text: str | None = None, timeout: float = 120) -> str:
    """Runs kubectl; gives its stdout."""
    command = [kubectl_path() or "kubectl", *args]
    if namespace:
        command += ["-n", namespace]
    done = subprocess.run(command, capture_output=True, text=True, check=False,
                          input=input_text, timeout=timeout)
    if check and done.returncode:
        raise AssertionError(f"{' '.join(command)} failed: {done.stderr.strip()}")
    return done.stdout


def wait_for(check, timeout: float, what: str, interval: float = 3.0):
    """Gives the first truthy result of `check` within `timeout` seconds, else fails."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"{what} did not happen within {timeout} s (last: {last!r})")
