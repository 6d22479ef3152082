"""The progress line `kvpilot fetch` prints, and reading it back as the operator does."""

from __future__ import annotations

from pathlib import Path

import pytest
from hub_standin import Hub, HubServer, Repo

from kvpilot.operator.weights.fetch import fetch
from kvpilot.operator.weights.progress import last_percent, progress_line
from kvpilot.operator.weights.request import FetchRequest


@pytest.mark.parametrize(("done", "total", "line"), [
    (0, 1000, "kvpilot fetch: 0% (0 of 1000 bytes)"),
    (999, 1000, "kvpilot fetch: 99% (999 of 1000 bytes)"),  # floors: 100 only when whole
    (1000, 1000, "kvpilot fetch: 100% (1000 of 1000 bytes)"),
    (1200, 1000, "kvpilot fetch: 100% (1000 of 1000 bytes)"),  # metadata files on disk
    (0, 0, "kvpilot fetch: 100% (0 of 0 bytes)"),
])
def test_progress_line(done: int, total: int, line: str):
    assert progress_line(done, total) == line


@pytest.mark.parametrize(("log", "percent"), [
    ("", None),
    ("kvpilot fetch: acme/x@main is commit abc: 3 files\n", None),
    ("kvpilot fetch: 12% (12 of 100 bytes)\nkvpilot fetch: 40% (40 of 100 bytes)\n", 40),
    ("kvpilot fetch: 40% (40 of 100 bytes)\nsome warning\n", 40),
    ("2026-01-01T00:00:00Z kvpilot fetch: 7% (7 of 100 bytes)", None),  # only whole lines
])
def test_last_percent(log: str, percent: int | None):
    assert last_percent(log) == percent


def test_a_slow_download_reports_progress_between_0_and_100(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    data = bytes(range(256)) * 4 * 2048  # 2 MiB in 32 chunks of 64 KiB
    state = Hub({"acme/x": Repo({"c" * 40: {"model.safetensors": data, "config.json": b"{}"}},
                                {"main": "c" * 40})})
    state.chunk_delay = 0.05
    lines: list[str] = []
    with HubServer(state) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)  # after huggingface_hub was imported: still used
        fetch(FetchRequest("acme/x"), tmp_path, lines.append, interval=0.2)
    percents = [p for p in map(last_percent, lines) if p is not None]
    assert percents[-1] == 100
    assert any(0 < p < 100 for p in percents), lines
    assert percents == sorted(percents)
