"""Operator start-up and shut-down: login, the shared API client, and kopf settings."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import kopf

from kvpilot.operator.kube.client import Kube
from kvpilot.operator.kube.login import LoginError, login
from kvpilot.operator.render.meta import MODEL_LABEL, RenderConfig

# kopf ignores every annotation under its storage prefix when diffing, so it must not be
# the prefix of annotations that should trigger handlers (kvpilot.dev/model-generation).
ANNOTATION_PREFIX = "kopf.kvpilot.dev"


@kopf.on.login()
async def login_handler(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    """Gives kopf the same credentials the handlers' client uses (again when they expire)."""
    try:
        return await asyncio.to_thread(login, settings)  # an exec plugin may run
    except LoginError as exc:
        raise kopf.LoginError(str(exc)) from exc


@kopf.on.startup()
async def open_client(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Puts the API client and the render settings into the operator memo."""
    memo.kube = Kube(await asyncio.to_thread(login, settings),
                     relogin=functools.partial(login, settings))
    if getattr(memo, "render", None) is None:
        memo.render = RenderConfig()


@kopf.on.cleanup()
async def close_client(memo: kopf.Memo, **_: Any) -> None:
    """Closes the API client."""
    kube = getattr(memo, "kube", None)
    if kube is not None:
        await kube.close()


def operator_settings(fast: bool = False) -> kopf.OperatorSettings:
    """Gives kopf settings: state in annotations (status stays ours), few events, optional fast waits."""
    settings = kopf.OperatorSettings()
    # kopf's bookkeeping goes to annotations so `.status` holds only kvpilot's fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration")
    settings.persistence.finalizer = "kvpilot.dev/finalizer"
    # Handlers post their own decision events; kopf's per-handler log lines stay in the log.
    settings.posting.level = logging.WARNING
    settings.networking.request_timeout = 30
    # Only pods of kvpilot's workloads and weights Jobs (they carry the model label) reach
    # the operator: the API server filters, so a big cluster's other pods cost nothing.
    settings.watching.label_selectors["", "v1", "pods"] = MODEL_LABEL
    # No CRD or namespace scanning: kopf serves the resources discovery shows at start and
    # the namespaces named, so the operator needs no cluster-scoped reads (kvpilot.operator.rbac).
    settings.scanning.disabled = True
    if fast:
        settings.watching.connect_timeout = 5
        settings.watching.server_timeout = 30
        settings.watching.reconnect_backoff = 0.2
        settings.batching.batch_window = 0.05
        settings.batching.idle_timeout = 0.5
        settings.batching.exit_timeout = 0.5
        settings.persistence.consistency_timeout = 1
    return settings
