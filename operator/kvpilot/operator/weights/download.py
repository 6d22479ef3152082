"""One file over HTTP into a directory, resumable across processes.

Bytes go to `<dir>/.kvpilot/partial/<name>.<etag>.part`, appended in order; a later run
(a restarted pod, the Job's next attempt) asks for the rest with a `Range` request. The
part becomes the file by rename only once its size and, for LFS files, its sha256 match
what the Hub listed, so a file in place is always whole. (huggingface_hub's own
downloader writes to a per-process name and deletes it on failure: it resumes within a
process, never across one.)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx

from kvpilot.operator.weights.hub import FetchError, HubFile

PARTIAL = Path(".kvpilot") / "partial"
CHUNK = 1 << 20


def part_path(local_dir: Path, file: HubFile, commit: str) -> Path:
    """Gives where the partial bytes of `file` at `commit` accumulate."""
    return local_dir / PARTIAL / f"{file.path.replace('/', '%2F')}.{commit[:12]}.part"


def is_done(local_dir: Path, file: HubFile) -> bool:
    """Gives whether `file` is in place (only whole files are ever renamed there)."""
    path = local_dir / file.path
    return path.is_file() and path.stat().st_size == file.size


def download(client: httpx.Client, url: str, headers: dict[str, str], local_dir: Path,
             file: HubFile, commit: str) -> int:
    """Puts `file` into `local_dir`, resuming its partial bytes; gives the bytes fetched now."""
    part = part_path(local_dir, file, commit)
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if have > file.size:  # not this file's bytes: start over
        part.unlink()
        have = 0
    fetched = 0
    if have < file.size:
        ranged = {**headers, "Range": f"bytes={have}-"} if have else headers
        with client.stream("GET", url, headers=ranged) as response:
            if response.status_code in (401, 403):
                raise PermissionError(url)
            if response.status_code >= 400:
                raise FetchError(f"GET {url} answered {response.status_code}: "
                                 f"{response.read()[:200]!r}", retryable=True)
            mode = "ab" if have and response.status_code == 206 else "wb"  # 200: no ranges
            with part.open(mode) as out:
                for chunk in response.iter_bytes(CHUNK):
                    out.write(chunk)
                    fetched += len(chunk)
                out.flush()
                os.fsync(out.fileno())
    _check(part, file)
    target = local_dir / file.path
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, target)
    return fetched


def _check(part: Path, file: HubFile) -> None:
    size = part.stat().st_size
    if size != file.size:
        raise FetchError(f"{file.path}: got {size} bytes, the Hub listed {file.size}; "
                         "the next attempt resumes", retryable=True)
    if file.sha256 is None:
        return
    digest = hashlib.sha256()
    with part.open("rb") as data:
        while block := data.read(CHUNK * 8):
            digest.update(block)
    if digest.hexdigest() != file.sha256:
        part.unlink()
        raise FetchError(f"{file.path}: sha256 {digest.hexdigest()} differs from the Hub's "
                         f"{file.sha256}; the partial file was dropped, the next attempt "
                         "downloads it again", retryable=True)
