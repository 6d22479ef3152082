"""A local stand-in for the Hugging Face Hub's HTTP API, enough for huggingface_hub's downloads.

It serves what `snapshot_download(local_dir=...)` calls (read from huggingface_hub's
code): `GET /api/models/{repo}[/revision/{rev}]` (repo_info: the commit `sha`),
`GET /api/models/{repo}/tree/{rev}` (the file list with sizes), and `HEAD`/`GET
/{repo}/resolve/{rev}/{path}` with `X-Repo-Commit`, `ETag`, `Content-Length` and byte
ranges (resumed downloads). Errors carry `X-Error-Code` as the Hub's do. Every request
is logged, so tests can say what was (not) fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlparse


@dataclass
class Repo:
    """One repository: commits by sha, branch/tag names pointing at them, an optional token."""

    commits: dict[str, dict[str, bytes]]
    refs: dict[str, str]
    token: str | None = None
    """When set, every request must carry `Authorization: Bearer <token>` (a gated repo)."""


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    auth: str | None


@dataclass
class Hub:
    """The stand-in's state: repositories, the request log, and a per-chunk delay for GETs."""

    repos: dict[str, Repo]
    log: list[Request] = field(default_factory=list)
    chunk_delay: float = 0.0
    """Seconds between 64 KiB chunks of a file body (lets a test interrupt a download)."""
    url: str = ""

    def downloads(self) -> list[Request]:
        """Gives the GETs of file contents."""
        return [r for r in self.log if r.method == "GET" and "/resolve/" in r.path]


def etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    hub: Hub

    def log_message(self, *_: Any) -> None:  # quiet
        return

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _error(self, status: int, code: str, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(payload)

    def _json(self, value: Any) -> None:
        payload = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _serve(self, body: bool) -> None:
        path = unquote(urlparse(self.path).path)
        self.hub.log.append(Request(self.command, path, self.headers.get("Range"),
                                    self.headers.get("Authorization")))
        api = path.startswith("/api/models/")
        parts = path.removeprefix("/api/models/" if api else "/").split("/")
        repo_id = "/".join(parts[:2])
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(401, "RepoNotFound", f"Repository Not Found for url: {path}")
        if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted.")
        rest = parts[2:]
        if api:
            return self._api(repo_id, repo, rest)
        if len(rest) < 3 or rest[0] != "resolve":
            return self._error(404, "EntryNotFound", path)
        return self._file(repo, rest[1], "/".join(rest[2:]), body)

    def _commit(self, repo: Repo, revision: str) -> str | None:
        sha = repo.refs.get(revision, revision)
        return sha if sha in repo.commits else None

    def _api(self, repo_id: str, repo: Repo, rest: list[str]) -> None:
        revision = rest[1] if len(rest) >= 2 else "main"
        sha = self._commit(repo, revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        files = repo.commits[sha]
        if not rest or rest[0] == "revision":
            return self._json({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                               "siblings": [{"rfilename": name} for name in files]})
        if rest[0] == "tree":
            return self._json([self._entry(name, data) for name, data in files.items()])
        return self._error(404, "EntryNotFound", "/".join(rest))

    @staticmethod
    def _entry(name: str, data: bytes) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "path": name, "size": len(data),
                                 "oid": hashlib.sha1(data).hexdigest()}
        if name.endswith(".safetensors"):  # the Hub keeps weights in LFS, with their sha256
            entry["lfs"] = {"oid": etag(data), "size": len(data), "pointerSize": 134}
        return entry

    def _file(self, repo: Repo, revision: str, name: str, body: bool) -> None:
        sha = self._commit(repo, revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        data = repo.commits[sha].get(name)
        if data is None:
            return self._error(404, "EntryNotFound", f"{name} not in {sha}")
        start = 0
        ranged = self.headers.get("Range")
        if ranged and ranged.startswith("bytes="):
            start = int(ranged.removeprefix("bytes=").split("-")[0])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", f'"{etag(data)}"')
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        chunk = 64 * 1024
        try:
            for offset in range(start, len(data), chunk):
                self.wfile.write(data[offset:offset + chunk])
                self.wfile.flush()
                if self.hub.chunk_delay:
                    time.sleep(self.hub.chunk_delay)
        except (BrokenPipeError, ConnectionResetError):
            return  # the client went away (an interrupted download)


class HubServer:
    """Runs a Hub stand-in on 127.0.0.1 in a thread; `with HubServer(hub) as url:`."""

    def __init__(self, hub: Hub) -> None:
        handler = type("Handler", (_Handler,), {"hub": hub})
        self.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        host, port = self.server.server_address[:2]
        self.hub.url = f"http://{host}:{port}"
        return self.hub.url

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
