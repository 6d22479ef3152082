"""A kmock Kubernetes emulator grown just far enough for an operator to run against it.

kmock's `KubernetesEmulator` stores objects as plain JSON and merges patches.
The operator also needs what a real API server adds: `metadata.uid`,
`generation` (bumped only when `spec` changes), `resourceVersion`,
`creationTimestamp`, `metadata.generateName`, a `status` subresource that ignores
everything but `status`, a `scale` subresource that takes only `spec.replicas`, HTTP 422 for
a failed JSON-patch `test`, cascading deletion through owner references, and server-side
apply with `managedFields` (field_managers.py). This module adds those and nothing else;
decisions 0017 and 0050 say what it still does not prove (admission, schema defaulting and
validation, keyed list merges, real controllers).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
import itertools
import json
import uuid
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from field_managers import Conflicts, apply, conflict_status, update
from kmock._internal import dicts, enums

CORE_RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/services": {"kind": "Service", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True},
    "v1/serviceaccounts": {"kind": "ServiceAccount", "namespaced": True},
    "rbac.authorization.k8s.io/v1/roles": {"kind": "Role", "namespaced": True},
    "rbac.authorization.k8s.io/v1/rolebindings": {"kind": "RoleBinding", "namespaced": True},
    "v1/pods": {"kind": "Pod", "namespaced": True, "subresources": {"status"}},
    "v1/persistentvolumeclaims": {"kind": "PersistentVolumeClaim", "namespaced": True,
                                  "subresources": {"status"}},
    "batch/v1/jobs": {"kind": "Job", "namespaced": True, "subresources": {"status"}},
    "apps/v1/deployments": {"kind": "Deployment", "namespaced": True,
                            "subresources": {"status", "scale"}},
    "apps/v1/statefulsets": {"kind": "StatefulSet", "namespaced": True,
                             "subresources": {"status", "scale"}},
    "policy/v1/poddisruptionbudgets": {"kind": "PodDisruptionBudget", "namespaced": True,
                                       "subresources": {"status"}},
    "apiextensions.k8s.io/v1/customresourcedefinitions": {
        "kind": "CustomResourceDefinition", "namespaced": False, "subresources": {"status"}},
}
IMMUTABLE_SELECTORS = {"deployments", "statefulsets"}  # as the real API server enforces
APPLY_PATCH = "application/apply-patch+yaml"
VERBS = {"create", "delete", "get", "list", "patch", "update", "watch"}


class _DirectCrud(kmock.RawHandler):
    """Serves single-object reads and writes without kmock's reaction matching.

    kmock matches each request against every reaction by re-filtering the requests it
    holds; that costs far more than the emulation itself once thousands of objects
    flow. Lists, watches and discovery still go through kmock's own machinery.
    """

    _DIRECT = frozenset({enums.action.FETCH, enums.action.CREATE, enums.action.UPDATE,
                         enums.action.DELETE})

    async def _handle(self, request: kmock.Request) -> Any:
        if request.resource is not None and request.action in self._DIRECT:
            serve = {enums.action.FETCH: self._serve_fetch, enums.action.CREATE: self._serve_create,
                     enums.action.UPDATE: self._serve_update,
                     enums.action.DELETE: self._serve_delete}[request.action]
            return aiohttp.web.json_response(await serve(request))  # type: ignore[attr-defined]
        return await super()._handle(request)


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator, _DirectCrud):
    """Gives a kmock emulator with API-server metadata, status subresources and cascading GC."""

    _versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    _with_status: set[Any] = attrs.field(factory=set, init=False)
    calls: collections.Counter[tuple[str, str]] = attrs.field(factory=collections.Counter,
                                                              init=False)
    """Requests served, by (action, resource plural[/subresource]): list, watch, fetch, ..."""
    base_url: str = attrs.field(default="", init=False)
    """http://host:port the emulator listens on (set by whoever starts its server)."""
    pod_logs: dict[tuple[str, str, str], str] = attrs.field(factory=dict, init=False)
    """What GET pods/{name}/log answers, by (namespace, pod, container): a test plays the kubelet."""
    tokens: set[str] | None = attrs.field(default=None, init=False)
    """Bearer tokens it accepts (401 for any other request); None: no authentication."""

    def add_resource(self, key: str, kind: str, namespaced: bool = True,
                     subresources: set[str] | frozenset[str] = frozenset(),
                     shortnames: set[str] | frozenset[str] = frozenset(),
                     categories: set[str] | frozenset[str] = frozenset()) -> None:
        """Registers one resource for discovery, listing and watching."""
        self.resources[key] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, singular=kind.lower(), verbs=set(VERBS),
            subresources=set(subresources), shortnames=set(shortnames),
            categories=set(categories))
        if "status" in subresources:
            self._with_status.add(kmock.resource(key))

    def add_core_resources(self) -> None:
        """Registers the built-in resources the operator reads and writes."""
        for key, info in CORE_RESOURCES.items():
            self.add_resource(key, **info)

    def add_crd(self, crd: dict[str, Any]) -> None:
        """Registers a CustomResourceDefinition: its resource and the CRD object itself."""
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            self.add_resource(
                f"{spec['group']}/{version['name']}/{names['plural']}", kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                subresources=set(version.get("subresources", {})),
                shortnames=set(names.get("shortNames", [])),
                categories=set(names.get("categories", [])))
        crds = kmock.resource("apiextensions.k8s.io/v1/customresourcedefinitions")
        self.objects[crds, None, crd["metadata"]["name"]] = self._stamp(copy.deepcopy(crd))

    def live(self, key: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Gives the current (not deleted) objects of one resource."""
        resource = kmock.resource(key)
        return [obj.raw for (res, ns, _), obj in self.objects.items()
                if res == resource and not obj.deleted
                and (namespace is None or ns == namespace)]

    def get(self, key: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """Gives one current object, or None."""
        object_key = (kmock.resource(key), namespace, name)
        if object_key not in self.objects or self.objects[object_key].deleted:
            return None
        return self.objects[object_key].raw

    # kmock finds the object of a fetch, create, patch or delete by scanning every stored
    # object; with thousands of objects (the convergence benchmark) that dominates. These
    # look the key up directly and answer the same thing.
    def _lookup(self, request: kmock.Request) -> dict[str, Any]:
        name = request.name or (request.data or {}).get("metadata", {}).get("name")
        namespace = request.namespace or (request.data or {}).get("metadata", {}).get("namespace")
        key = (request.resource, namespace, name)
        if key not in self.objects:
            raise kmock.KubernetesObjectNotFoundError()
        return self.objects[key]

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        obj = self._lookup(request)
        if obj.deleted:
            raise kmock.KubernetesObjectNotFoundError()
        return obj.raw

    async def _serve_create(self, request: kmock.Request) -> Any:
        return self._lookup(request).raw

    async def _serve_update(self, request: kmock.Request) -> Any:
        return self._lookup(request).last.raw

    async def _serve_delete(self, request: kmock.Request) -> Any:
        return self._lookup(request).last.raw

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> Any:
        # kmock 0.8 cannot parse the path /api/v1/namespaces (it takes "namespaces" for the
        # namespace prefix and fails), which kopf lists and watches when it serves named
        # namespaces; answer that one path here.
        if self.tokens is not None and raw_request.headers.get("Authorization") not in \
                {f"Bearer {token}" for token in self.tokens}:
            return aiohttp.web.json_response(
                {"kind": "Status", "code": 401, "reason": "Unauthorized", "message": "Unauthorized"},
                status=401)
        if raw_request.path.rstrip("/") == "/api/v1/namespaces":
            return await self._serve_namespaces(raw_request)
        parts = raw_request.path.strip("/").split("/")
        if len(parts) == 7 and parts[:3] == ["api", "v1", "namespaces"] and \
                parts[4] == "pods" and parts[6] == "log":
            key = (parts[3], parts[5], raw_request.query.get("container", ""))
            if key not in self.pod_logs:
                return aiohttp.web.json_response({"message": "not found"}, status=404)
            tail = int(raw_request.query.get("tailLines", "0") or 0)
            lines = self.pod_logs[key].splitlines(keepends=True)
            return aiohttp.web.Response(text="".join(lines[-tail:] if tail else lines))
        return await super().__call__(raw_request)

    async def _serve_namespaces(self, raw_request: aiohttp.web.BaseRequest) -> Any:
        items = self.live("v1/namespaces")
        if raw_request.query.get("watch") != "true":
            return aiohttp.web.json_response(
                {"apiVersion": "v1", "kind": "NamespaceList",
                 "metadata": {"resourceVersion": str(next(self._versions))}, "items": items})
        response = aiohttp.web.StreamResponse()
        await response.prepare(raw_request)
        for item in items:
            await response.write(json.dumps({"type": "ADDED", "object": item}).encode() + b"\n")
        # Namespaces do not change in these tests: hold the stream open until the client goes.
        while not raw_request.transport or not raw_request.transport.is_closing():
            await asyncio.sleep(1)
        return response

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("generation", 1)
        meta.setdefault("creationTimestamp",
                        datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["resourceVersion"] = str(next(self._versions))
        return obj

    async def _handle(self, request: kmock.Request) -> Any:
        # The request is frozen but its parsed body is a dict: amend it in place, before
        # the base class stores it, the way an API server's registry would.
        if request.resource is not None and request.action is not None:
            plural = f"{request.resource.plural}/{request.subresource or ''}".rstrip("/")
            self.calls[request.action.name.lower(), plural] += 1
        if request.resource is not None and request.action == enums.action.UPDATE and \
                request.headers.get("Content-Type", "").startswith(APPLY_PATCH):
            try:
                return await self._serve_apply(request)
            finally:
                self._forget(request)
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == enums.action.CREATE:
                meta = request.data.setdefault("metadata", {})
                # kopf posts every event under one generateName: 8 hex digits keep them apart.
                if not meta.get("name") and meta.get("generateName"):
                    meta["name"] = meta["generateName"] + uuid.uuid4().hex[:8]
                if request.namespace:
                    request.data.setdefault("metadata", {})["namespace"] = request.namespace
                request.data.pop("status", None) if request.resource in self._with_status else None
                self._stamp(request.data)
                update(None, request.data, _manager(request))
            elif request.action == enums.action.UPDATE and request.name is not None:
                self._amend_patch(request)
        try:
            response = await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as exc:
            # A failed `test` of resourceVersion is a conflict the client retries, as a real
            # API server's 422 says (kopf stalls the object for backed-off attempts on a 500).
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        finally:
            # kmock keeps every request and matches each new one by scanning them all
            # (quadratic); keep only those in flight so thousands of requests stay cheap.
            self._forget(request)
        if request.action == enums.action.DELETE and request.name is not None:
            await self._collect_garbage()
        elif request.action == enums.action.UPDATE and request.name is not None:
            # The last finalizer removed from a deleting object (kopf's, on objects with
            # timers) deletes it; its dependents follow, as after a DELETE.
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and self.objects[key].deleted:
                await self._collect_garbage()
        return response

    def _forget(self, request: kmock.Request) -> None:
        for index in range(len(self._requests) - 1, -1, -1):
            if self._requests[index] is request:
                del self._requests[index]
                return

    def _amend_patch(self, request: kmock.Request) -> None:
        patch: dict[str, Any] = request.data
        if request.subresource == "scale":  # a Scale object: only its replicas reach the spec
            replicas = (patch.get("spec") or {}).get("replicas")
            patch.clear()
            patch.update({"spec": {"replicas": replicas}} if replicas is not None else {})
        elif request.resource in self._with_status:
            if request.subresource == "status":
                kept = {"status": patch.get("status")} if "status" in patch else {}
                patch.clear()
                patch.update(kept)
            else:
                patch.pop("status", None)
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            current = self.objects[key].raw
            merged = copy.deepcopy(dict(dicts.merge_patch_dict(current, patch)))
            self._check_selector(request, current, merged)
            if merged.get("spec") != current.get("spec"):
                generation = current.get("metadata", {}).get("generation", 1) + 1
                patch.setdefault("metadata", {})["generation"] = generation
            update(current, merged, _manager(request), request.subresource or "")
            patch.setdefault("metadata", {})["managedFields"] = merged["metadata"]["managedFields"]
        patch.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))

    @staticmethod
    def _check_selector(request: kmock.Request, current: dict[str, Any],
                        new: dict[str, Any]) -> None:
        if request.resource is not None and request.resource.plural in IMMUTABLE_SELECTORS and \
                (new.get("spec") or {}).get("selector") != \
                (current.get("spec") or {}).get("selector"):
            raise kmock.KubernetesError(
                status=422, reason="Invalid",
                message=f"{request.resource.plural} {request.name}: spec.selector: "
                        "Invalid value: field is immutable")

    async def _serve_apply(self, request: kmock.Request) -> Any:
        """Server-side apply: merge by field ownership, 409 on conflicts, create when absent."""
        manager = request.params.get("fieldManager")
        if request.name is None or request.subresource or not isinstance(request.data, dict):
            raise kmock.KubernetesError(status=415, reason="UnsupportedMediaType",
                                        message="the emulator applies whole objects only")
        if not manager:
            raise kmock.KubernetesError(status=422, reason="Invalid",
                                        message="fieldManager is required for apply patch")
        applied = copy.deepcopy(request.data)
        if request.resource in self._with_status:
            applied.pop("status", None)
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            exists = key in self.objects and not self.objects[key].deleted
            current = self.objects[key].raw if exists else None
            try:
                new = apply(current, applied, manager, request.params.get("force") == "true")
            except Conflicts as exc:
                raise kmock.KubernetesError(status=409, reason="Conflict", **conflict_status(
                    exc.found, applied.get("apiVersion", ""))) from exc
            if current is not None:
                if new == current:
                    return aiohttp.web.json_response(current)  # a no-op writes nothing
                self._check_selector(request, current, new)
                if new.get("spec") != current.get("spec"):
                    new["metadata"]["generation"] = current["metadata"].get("generation", 1) + 1
                new["metadata"]["resourceVersion"] = str(next(self._versions))
                self.objects[key].create(new)
                event = "MODIFIED"
            else:
                new["metadata"].update(name=request.name, namespace=request.namespace)
                self.objects[key] = self._stamp(new)
                event = "ADDED"
            stored = self.objects[key].raw
            await self._buses[request.resource].put({"type": event, "object": stored})
        return aiohttp.web.json_response(stored, status=201 if current is None else 200)

    async def _collect_garbage(self) -> None:
        # Deleting an owner deletes its dependents (background cascading deletion).
        while True:
            live_uids = {obj.raw.get("metadata", {}).get("uid")
                         for obj in self.objects.values() if not obj.deleted}
            orphans = [
                (key, obj) for key, obj in self.objects.items() if not obj.deleted
                and any(ref.get("uid") not in live_uids
                        for ref in obj.raw.get("metadata", {}).get("ownerReferences", []))
            ]
            if not orphans:
                return
            async with self._lock:
                for (resource, _, _), obj in orphans:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})


def _manager(request: kmock.Request) -> str:
    """Gives the field manager of a write: its fieldManager, else its User-Agent's product."""
    return request.params.get("fieldManager") or \
        request.headers.get("User-Agent", "unknown").split("/")[0]
