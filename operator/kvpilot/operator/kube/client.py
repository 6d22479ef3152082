"""A small async Kubernetes API client for the handlers: get, list, apply, patch, delete.

Handlers write whole rendered objects by server-side apply (`apply`): one PATCH that creates
or updates, under a field manager, so the API server records which fields the operator owns,
refuses (409) to take fields another writer owns unless forced, removes fields the operator
stops applying, and writes nothing when nothing changed. Every other write carries the
client's field manager too, so `managedFields` name kvpilot for all of them.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import ssl
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import kopf

from kvpilot.operator.kube.errors import FieldConflict, KubeError, conflicts_in

MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}
# JSON is YAML: the body stays JSON, the content type selects server-side apply.
APPLY_PATCH = {"Content-Type": "application/apply-patch+yaml"}
EXPIRY_MARGIN = datetime.timedelta(seconds=60)
"""Credentials this close to their expiry are renewed before the next call."""
FIELD_MANAGER = "kvpilot"
"""The field manager of the operator's reconcilers (kvpilot.operator.ownership has the others)."""


def resource_path(api_version: str, kind: str, namespace: str | None,
                  name: str | None = None, subresource: str | None = None) -> str:
    """Gives the REST path of a kind (plural = lower-case kind + 's', true for every kind used)."""
    root = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    parts = [root]
    if namespace:
        parts += ["namespaces", namespace]
    parts.append(kind.lower() + "s")
    if name:
        parts.append(name)
    if subresource:
        parts.append(subresource)
    return "/".join(parts)


class Kube:
    """Async JSON client over one API server connection (the operator's credentials).

    aiohttp rather than httpx: kopf already depends on it, and its connection pool costs
    a fraction of the CPU per request, which matters with thousands of objects.
    """

    def __init__(self, info: kopf.ConnectionInfo, *,
                 relogin: Callable[[], kopf.ConnectionInfo] | None = None,
                 max_connections: int = 64, field_manager: str = FIELD_MANAGER) -> None:
        """`relogin` gives fresh credentials when these expire or the server answers 401."""
        self._manager = field_manager
        self._relogin = relogin
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._use(info)

    def _use(self, info: kopf.ConnectionInfo) -> None:
        self._server = info.server.rstrip("/")
        self._headers = {"Authorization": f"{info.scheme or 'Bearer'} {info.token}"} \
            if info.token else {}
        self._ssl: ssl.SSLContext | bool = not info.insecure
        cert = (os.fsdecode(info.certificate_path), os.fsdecode(info.private_key_path)) \
            if info.certificate_path and info.private_key_path else None
        if not info.insecure and (info.ca_path or cert):
            context = ssl.create_default_context(
                cafile=os.fsdecode(info.ca_path) if info.ca_path else None)
            if cert:
                context.load_cert_chain(*cert)
            self._ssl = context
        expiration = info.expiration
        if expiration is not None and expiration.tzinfo is None:
            expiration = expiration.replace(tzinfo=datetime.UTC)
        self._expiration = expiration

    async def _log_in_again(self) -> None:
        assert self._relogin is not None
        self._use(await asyncio.to_thread(self._relogin))  # an exec plugin may run
        await self.close()

    async def close(self) -> None:
        """Closes the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, verb: str, path: str, *, body: Any = None,
                    params: Mapping[str, str] | None = None,
                    headers: Mapping[str, str] | None = None) -> tuple[int, str]:
        if self._relogin is not None and self._expiration is not None and \
                datetime.datetime.now(datetime.UTC) + EXPIRY_MARGIN >= self._expiration:
            await self._log_in_again()
        status, text = await self._send(verb, path, body, params, headers)
        if status == 401 and self._relogin is not None:  # e.g. a rotated token
            await self._log_in_again()
            status, text = await self._send(verb, path, body, params, headers)
        return status, text

    async def _send(self, verb: str, path: str, body: Any, params: Mapping[str, str] | None,
                    headers: Mapping[str, str] | None) -> tuple[int, str]:
        if self._session is None:  # created lazily: it must belong to the running loop
            self._session = aiohttp.ClientSession(
                # No total timeout: waiting for a free pooled connection under a burst of
                # thousands of objects is not a failure; a silent server still is.
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=30),
                connector=aiohttp.TCPConnector(limit=self._max_connections, ssl=self._ssl))
        data = None if body is None else json.dumps(body)
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        async with self._session.request(verb, self._server + path, data=data,
                                         params=params, headers=all_headers) as response:
            return response.status, await response.text()

    async def version(self) -> dict[str, Any]:
        """Gives the API server's /version (what `kvpilot operator` checks before it starts)."""
        return self._ok("GET", "/version", *await self._call("GET", "/version"))

    async def get(self, api_version: str, kind: str, namespace: str | None,
                  name: str) -> dict[str, Any] | None:
        """Gives one object, or None when it does not exist."""
        path = resource_path(api_version, kind, namespace, name)
        status, text = await self._call("GET", path)
        if status == 404:
            return None
        return self._ok("GET", path, status, text)

    async def list(self, api_version: str, kind: str, namespace: str | None,
                   labels: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Gives the objects of a kind matching `labels` (also filtered here, for lax servers)."""
        path = resource_path(api_version, kind, namespace)
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in labels.items())} \
            if labels else None
        items = self._ok("LIST", path, *await self._call("GET", path, params=params))
        wanted = dict(labels or {})
        return [item for item in items.get("items", [])
                if wanted.items() <= (item.get("metadata", {}).get("labels") or {}).items()]

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Creates an object; raises KubeError (status 409 when the name is taken)."""
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"))
        return self._ok("POST", path, *await self._call("POST", path, body=obj,
                                                        params=self._managed()))

    async def patch(self, api_version: str, kind: str, namespace: str | None, name: str,
                    body: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]:
        """Merge-patches an object (or its status subresource)."""
        path = resource_path(api_version, kind, namespace, name, subresource)
        return self._ok("PATCH", path, *await self._call("PATCH", path, body=body,
                                                         params=self._managed(),
                                                         headers=MERGE_PATCH))

    async def delete(self, api_version: str, kind: str, namespace: str | None,
                     name: str) -> bool:
        """Deletes an object in the background (dependents by GC); gives False if it was gone."""
        path = resource_path(api_version, kind, namespace, name)
        status, text = await self._call("DELETE", path, body={"propagationPolicy": "Background"})
        if status == 404:
            return False
        self._ok("DELETE", path, status, text)
        return True

    async def apply(self, obj: Mapping[str, Any], *, force: bool = False,
                    manager: str | None = None) -> tuple[bool, dict[str, Any]]:
        """Server-side applies `obj` (created when absent); gives (created, the stored object).

        The fields in `obj` become `manager`'s (default: the client's). Raises FieldConflict
        when another manager owns one of them with another value, unless `force` takes them.
        """
        meta = obj["metadata"]
        path = resource_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        params = {**self._managed(manager), "force": "true" if force else "false"}
        status, text = await self._call("PATCH", path, body=obj, params=params,
                                        headers=APPLY_PATCH)
        if status == 409 and (conflicts := conflicts_in(text)):
            raise FieldConflict("APPLY", path, text, conflicts)
        return status == 201, self._ok("APPLY", path, status, text)

    def _managed(self, manager: str | None = None) -> dict[str, str]:
        return {"fieldManager": manager or self._manager}

    async def log(self, namespace: str, pod: str, container: str, tail_lines: int) -> str:
        """Gives the last `tail_lines` lines a container of a pod wrote; '' when it has none
        (the pod or container is gone or has not started)."""
        path = resource_path("v1", "Pod", namespace, pod, "log")
        status, text = await self._call("GET", path, params={"container": container,
                                                             "tailLines": str(tail_lines)})
        if status in (400, 404):
            return ""
        if not 200 <= status < 300:
            raise KubeError("GET", path, status, text)
        return text

    def _ok(self, verb: str, path: str, status: int, text: str) -> dict[str, Any]:
        if 200 <= status < 300:
            return json.loads(text)
        raise KubeError(verb, path, status, text)
