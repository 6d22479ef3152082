"""The progress line `kvpilot fetch` prints and the operator reads back from the pod's log."""

from __future__ import annotations

import re
from pathlib import Path

PREFIX = "kvpilot fetch:"
_LINE = re.compile(rf"^{re.escape(PREFIX)} (\d+)% \((\d+) of (\d+) bytes\)")


def progress_line(done: int, total: int) -> str:
    """Gives e.g. 'kvpilot fetch: 42% (4200 of 10000 bytes)'; percent floors, 100 only at the end."""
    percent = 100 if total <= 0 else min(100, done * 100 // total)
    return f"{PREFIX} {percent}% ({min(done, total)} of {total} bytes)"


def last_percent(log: str) -> int | None:
    """Gives the percent of the last progress line in `log`, or None when it has none."""
    for line in reversed(log.splitlines()):
        match = _LINE.match(line.strip())
        if match:
            return int(match.group(1))
    return None


def bytes_on_disk(local_dir: Path) -> int:
    """Gives the bytes of every file under `local_dir`, partial downloads included."""
    total = 0
    for path in local_dir.rglob("*"):
        try:
            if path.is_file():
                total += path.stat().st_size
        except OSError:  # a partial file renamed between listing and stat
            continue
    return total
