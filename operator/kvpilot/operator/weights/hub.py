"""What the Hub says about a repository: the commit a revision names, and its files with sizes.

huggingface_hub's `HfApi` makes the calls (`HF_ENDPOINT` and `HF_TOKEN` from the
environment); its errors become `FetchError`s that name the field to fix.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

from kvpilot.operator.weights.request import FetchRequest


class FetchError(Exception):
    """A download that cannot finish; the message names the field and the fix.

    `retryable`: another attempt may succeed (the network, the Hub); otherwise only a change
    of the spec helps, and `kvpilot fetch` exits 2, which fails the weights Job at once.
    """

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class HubFile:
    """One file of a commit: its path, size, and sha256 when the Hub stores it in LFS."""

    path: str
    size: int
    sha256: str | None = None


def endpoint() -> str | None:
    """Gives HF_ENDPOINT (a mirror) as set now; None: huggingface_hub's default, the Hub.

    Passed explicitly: huggingface_hub reads the variable once, when it is first imported.
    """
    return os.environ.get("HF_ENDPOINT") or None


def resolve_commit(request: FetchRequest) -> str:
    """Gives the commit `request.revision` names (the default branch when None)."""
    from huggingface_hub import HfApi

    with translated(request):
        commit = HfApi(endpoint=endpoint()).repo_info(request.repo,
                                                      revision=request.revision).sha
    if commit is None:
        raise FetchError(f"the Hub gave no commit for {request.describe()}", retryable=True)
    return commit


def list_files(request: FetchRequest, commit: str) -> list[HubFile]:
    """Gives the files of `commit` that `request`'s include/exclude globs select."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils import filter_repo_objects

    with translated(request):
        tree = [HubFile(f.path, int(f.size or 0), f.lfs.sha256 if f.lfs else None)
                for f in HfApi(endpoint=endpoint()).list_repo_tree(request.repo,
                                                                   revision=commit,
                                                                   recursive=True)
                if isinstance(f, RepoFile)]
    wanted = list(filter_repo_objects(tree, allow_patterns=list(request.include),
                                      ignore_patterns=list(request.exclude),
                                      key=lambda f: f.path))
    if not wanted:
        raise FetchError(
            f"no file of {request.describe()} matches include={list(request.include)} "
            f"exclude={list(request.exclude)} (it has {sorted(f.path for f in tree)[:8]}): "
            "fix spec.model.include / spec.model.exclude")
    return wanted


def file_url(request: FetchRequest, commit: str, path: str) -> str:
    """Gives the resolve URL of one file at `commit` (on HF_ENDPOINT)."""
    from huggingface_hub import hf_hub_url

    return hf_hub_url(request.repo, path, revision=commit, endpoint=endpoint())


def auth_headers() -> dict[str, str]:
    """Gives the Authorization header for HF_TOKEN, when it is set."""
    token = os.environ.get("HF_TOKEN")
    return {"Authorization": f"Bearer {token}"} if token else {}


def access_denied(request: FetchRequest) -> str:
    """Gives the message for a repository the token may not read."""
    if os.environ.get("HF_TOKEN"):
        return (f"{request.repo} is gated: the token of spec.model.secretRef has not been "
                "granted access; accept the model's licence on huggingface.co with that account")
    return (f"{request.repo} is gated: set spec.model.secretRef to a Secret whose HF_TOKEN "
            "has been granted access")


@contextlib.contextmanager
def translated(request: FetchRequest) -> Iterator[None]:
    """Turns huggingface_hub's errors into FetchErrors that say which field to fix."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except RevisionNotFoundError as exc:
        raise FetchError(f"spec.model.revision={request.revision!r} is not a branch, tag or "
                         f"commit of {request.repo}: fix spec.model.revision") from exc
    except GatedRepoError as exc:
        raise FetchError(access_denied(request)) from exc
    except RepositoryNotFoundError as exc:
        hint = "" if os.environ.get("HF_TOKEN") else (
            ", or set spec.model.secretRef to a Secret holding an HF_TOKEN that may read it")
        raise FetchError(f"{request.repo} does not exist or is private: check "
                         f"spec.model.source{hint}") from exc
    except (HfHubHTTPError, OSError) as exc:
        raise FetchError(f"reading {request.describe()} from the Hub failed: {exc}; the next "
                         "attempt starts over from what is on disk", retryable=True) from exc
    except Exception as exc:  # the HTTP client's own errors differ between hub versions
        raise FetchError(f"reading {request.describe()} from the Hub failed: "
                         f"{type(exc).__name__}: {exc}; the next attempt starts over from what "
                         "is on disk", retryable=True) from exc
