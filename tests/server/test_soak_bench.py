"""bench/soak.py's short run: a fleet under mixed traffic (disconnects, aborts, adapter
loads) returns to baseline; with leaks injected on purpose into the engine (the KV blocks of
one freed sequence in 40, a file descriptor per request its API server takes) the run fails
naming both resources."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "bench" / "soak.py"
SHORT = ["--cycles", "2", "--cycle-seconds", "3", "--concurrency", "4"]
# imported at start-up by every interpreter of the engine (its API server and core process)
LEAKS = '''
import itertools, os

from kvpilot.engine.core.kv_cache_manager import KVCacheManager
from kvpilot.engine.engine_loop.request_state import RequestState

_free, _freed, _forgotten = KVCacheManager.free, itertools.count(1), itertools.count(1)


def leaky_free(self, seq):
    # forget the blocks of one freed sequence in 40 (their ref counts never drop), at most 4
    # sequences' worth: enough to see, never so many that a loaded machine's longer run fills
    # the cache and its requests hang
    if next(_freed) % 40 == 0 and next(_forgotten) <= 4:
        self.block_tables.pop(seq.seq_id, None)
        return
    _free(self, seq)


_init, _kept = RequestState.__init__, []


def leaky_init(self, *args, **kwargs):
    _kept.append(open(os.devnull))
    _init(self, *args, **kwargs)


KVCacheManager.free = leaky_free
RequestState.__init__ = leaky_init
'''


def soak(out: Path, *extra: str) -> tuple[int, dict, str]:
    done = subprocess.run([sys.executable, str(BENCH), *SHORT, "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)
    report = json.loads((out / "soak.json").read_text()) if (out / "soak.json").exists() else {}
    return done.returncode, report, done.stdout[-2000:] + done.stderr[-3000:]


def test_the_short_soak_returns_to_baseline(tmp_path: Path) -> None:
    code, report, output = soak(tmp_path / "clean")
    assert code == 0, output
    assert all(v["ok"] for v in report["verdicts"].values()), report["verdicts"]
    kinds = {key.rsplit("-", 1)[0] for key in report["outcomes"]}
    assert {"complete", "stream", "chat", "disconnect", "abort", "adapter", "load", "unload",
            "churn"} <= kinds, report["outcomes"]
    assert "soak.md" in os.listdir(tmp_path / "clean")


def test_the_short_soak_fails_on_leaks_injected_on_purpose(tmp_path: Path) -> None:
    leaks = tmp_path / "leaks"
    leaks.mkdir()
    (leaks / "sitecustomize.py").write_text(LEAKS)
    code, report, output = soak(tmp_path / "leaky", "--engine-env",
                                f"PYTHONPATH={leaks}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert code == 1 and "verdicts" in report, output  # a run that broke wrote no report
    leaked = {key for key, v in report["verdicts"].items() if not v["ok"]}
    assert {"kv_blocks_in_use", "fds_engine_api"} <= leaked, report["verdicts"]
