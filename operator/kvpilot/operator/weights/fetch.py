"""Downloads a Hub repository's weights into a directory: filtered, pinned to one commit, resumable.

Runs where the weights are needed: an engine pod's init container (an emptyDir) or the
cache Job of an InferenceModel (its PersistentVolumeClaim). The revision is resolved to
a commit once per directory (`.kvpilot/commit.json`), so a branch that moves while a
download is interrupted cannot mix two commits' files; files download in parallel and
resume from their partial bytes (download.py); a progress line every few seconds goes to
the log, where the operator reads it; the marker written last makes the next run a no-op.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvpilot.operator.weights.download import download, is_done
from kvpilot.operator.weights.hub import (
    FetchError,
    HubFile,
    access_denied,
    auth_headers,
    file_url,
    list_files,
    resolve_commit,
)
from kvpilot.operator.weights.progress import PREFIX, bytes_on_disk, progress_line
from kvpilot.operator.weights.request import FetchRequest, Marker, read_marker, write_marker

Log = Callable[[str], None]
RESOLVED = Path(".kvpilot") / "commit.json"
WORKERS = 8
__all__ = ["FetchError", "fetch", "finished", "wait"]


def finished(request: FetchRequest, local_dir: Path) -> Marker | None:
    """Gives the marker of a finished download of exactly `request` in `local_dir`, or None."""
    marker = read_marker(local_dir)
    return marker if marker is not None and marker.request == request else None


def fetch(request: FetchRequest, local_dir: Path, log: Log, interval: float = 10.0) -> Marker:
    """Gives the marker of `request` in `local_dir`, downloading what is missing first.

    Raises FetchError naming the field to fix (source, revision, secretRef, filters);
    after a network error the next run resumes where this one stopped.
    """
    done = finished(request, local_dir)
    if done is not None:
        log(f"{PREFIX} {request.describe()} is already in {local_dir} (commit {done.commit}, "
            f"{done.files} files, {done.bytes} bytes): nothing to download")
        return done
    local_dir.mkdir(parents=True, exist_ok=True)
    commit = _commit(request, local_dir)
    files = list_files(request, commit)
    total = sum(f.size for f in files)
    todo = sorted((f for f in files if not is_done(local_dir, f)), key=lambda f: -f.size)
    log(f"{PREFIX} {request.describe()} is commit {commit}: {len(files)} files, {total} bytes "
        f"into {local_dir} ({len(files) - len(todo)} already there)")
    stop = threading.Event()
    reporter = threading.Thread(target=_report, args=(local_dir, total, log, interval, stop),
                                daemon=True)
    reporter.start()
    try:
        _download_all(request, commit, todo, local_dir)
    finally:
        stop.set()
        reporter.join()
    marker = Marker(request, commit, len(files), total)
    write_marker(local_dir, marker)
    log(progress_line(total, total))
    return marker


def wait(request: FetchRequest, local_dir: Path, log: Log, interval: float = 10.0,
         say_every: float = 60.0) -> Marker:
    """Gives the marker of `request` once another process (the cache Job) has written it."""
    said = -say_every
    started = time.monotonic()
    while True:
        done = finished(request, local_dir)
        if done is not None:
            log(f"{PREFIX} {request.describe()} is in {local_dir} (commit {done.commit})")
            return done
        waited = time.monotonic() - started
        if waited - said >= say_every:
            log(f"{PREFIX} waiting {waited:.0f}s for {request.describe()} in {local_dir}: the "
                "InferenceModel's weights Job fills it (kubectl get jobs -l kvpilot.dev/weights)")
            said = waited
        time.sleep(interval)


def _commit(request: FetchRequest, local_dir: Path) -> str:
    """Gives the commit this directory downloads: resolved by the first run, kept after."""
    path = local_dir / RESOLVED
    try:
        saved = json.loads(path.read_text())
        if saved.get("request") == [request.repo, request.revision]:
            return str(saved["commit"])
    except (OSError, ValueError, AttributeError):
        pass
    commit = resolve_commit(request)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"request": [request.repo, request.revision], "commit": commit}))
    return commit


def _download_all(request: FetchRequest, commit: str, files: list[HubFile],
                  local_dir: Path) -> None:
    headers = auth_headers()
    # httpx drops the Authorization header when a redirect leaves the Hub's host (the CDN).
    with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(60, connect=20)) as client, \
            concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
        jobs = [pool.submit(download, client, file_url(request, commit, f.path), headers,
                            local_dir, f, commit) for f in files]
        for job in concurrent.futures.as_completed(jobs):
            try:
                job.result()
            except PermissionError as exc:
                raise FetchError(access_denied(request)) from exc
            except (httpx.HTTPError, OSError) as exc:
                raise FetchError(f"downloading {request.describe()} failed: {exc}; the next "
                                 "attempt resumes where this one stopped",
                                 retryable=True) from exc


def _report(local_dir: Path, total: int, log: Log, interval: float,
            stop: threading.Event) -> None:
    while not stop.wait(interval):
        log(progress_line(bytes_on_disk(local_dir), total))
