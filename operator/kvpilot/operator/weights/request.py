"""What to download from the Hugging Face Hub, its cache key, and the marker a finished download leaves.

A download is keyed by repository, requested revision and file filters: the marker
`<dir>/.kvpilot/weights.json` records them (and the commit the revision resolved to),
so a second replica, a restarted pod or the cache Job's next pod finds a finished
download and fetches nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

# The files a Transformers-layout checkpoint needs to be served: weights, config,
# tokenizer and generation files. Not `original/` (Meta's consolidated copy, which doubles
# a Llama repository) nor `consolidated*.safetensors` (Mistral's second naming of the same
# weights); the engine reads `model*.safetensors` and the index's shards.
DEFAULT_INCLUDE = ("*.safetensors", "*.json", "tokenizer.model", "chat_template.jinja")
DEFAULT_EXCLUDE = ("original/*", "consolidated*.safetensors")
MARKER = Path(".kvpilot") / "weights.json"


@dataclass(frozen=True)
class FetchRequest:
    """One Hub download: repository, revision and the include/exclude filters."""

    repo: str
    revision: str | None = None
    """Branch, tag or commit; None: the repository's default branch."""
    include: tuple[str, ...] = DEFAULT_INCLUDE
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE

    def key(self) -> str:
        """Gives a short digest of the request: caches of different requests never mix."""
        text = json.dumps([self.repo, self.revision, list(self.include), list(self.exclude)])
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def describe(self) -> str:
        """Gives 'org/name@revision' for log lines and messages."""
        return f"{self.repo}@{self.revision or 'default branch'}"


@dataclass(frozen=True)
class Marker:
    """What a finished download wrote: the request, the commit it resolved to, its size."""

    request: FetchRequest
    commit: str
    files: int
    bytes: int


def read_marker(local_dir: Path) -> Marker | None:
    """Gives the marker of a finished download in `local_dir`, or None (absent or unreadable)."""
    try:
        data = json.loads((local_dir / MARKER).read_text())
        request = FetchRequest(data["repo"], data["revision"], tuple(data["include"]),
                               tuple(data["exclude"]))
        return Marker(request, data["commit"], int(data["files"]), int(data["bytes"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_marker(local_dir: Path, marker: Marker) -> None:
    """Writes the marker atomically: a reader sees the whole file or none."""
    path = local_dir / MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**asdict(marker.request), "commit": marker.commit, "files": marker.files,
            "bytes": marker.bytes}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
