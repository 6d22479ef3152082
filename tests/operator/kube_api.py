"""A kmock Kubernetes emulator grown just far enough for an operator to run against it.

kmock's `KubernetesEmulator` stores objects as plain JSON and merges patches.
The operator also needs what a real API server adds: `metadata.uid`,
`generation` (bumped only when `spec` changes), `resourceVersion`,
`creationTimestamp`, `metadata.generateName`, a `status` subresource that ignores
everything but `status`, HTTP 422 for a failed JSON-patch `test`, and cascading deletion
through owner references. This module adds those and nothing else; see
the reconcile section of docs/architecture.md for what it still does not prove (admission, schema
defaulting and validation, real controllers).
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
from kmock._internal import dicts, enums

CORE_RESOURCES: dict[str, dict[str, Any]] = {
    "v1/namespaces": {"kind": "Namespace", "namespaced": False},
    "v1/configmaps": {"kind": "ConfigMap", "namespaced": True},
    "v1/services": {"kind": "Service", "namespaced": True},
    "v1/events": {"kind": "Event", "namespaced": True},
    "v1/serviceaccounts": {"kind": "ServiceAccount", "namespaced": True},
    "v1/secrets": {"kind": "Secret", "namespaced": True},
    "networking.k8s.io/v1/networkpolicies": {"kind": "NetworkPolicy", "namespaced": True},
    "rbac.authorization.k8s.io/v1/roles": {"kind": "Role", "namespaced": True},
    "rbac.authorization.k8s.io/v1/rolebindings": {"kind": "RoleBinding", "namespaced": True},
    "v1/pods": {"kind": "Pod", "namespaced": True, "subresources": {"status"}},
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
        if raw_request.path.rstrip("/") == "/api/v1/namespaces":
            return await self._serve_namespaces(raw_request)
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
        return response

    def _forget(self, request: kmock.Request) -> None:
        for index in range(len(self._requests) - 1, -1, -1):
            if self._requests[index] is request:
                del self._requests[index]
                return

    def _amend_patch(self, request: kmock.Request) -> None:
        patch: dict[str, Any] = request.data
        if request.resource in self._with_status:
            if request.subresource == "status":
                kept = {"status": patch.get("status")} if "status" in patch else {}
                patch.clear()
                patch.update(kept)
            else:
                patch.pop("status", None)
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted and "spec" in patch:
            current = self.objects[key].raw
            merged = dicts.merge_patch_dict(current, patch)
            if request.resource.plural in IMMUTABLE_SELECTORS and \
                    merged["spec"].get("selector") != current.get("spec", {}).get("selector"):
                raise kmock.KubernetesError(
                    status=422, reason="Invalid",
                    message=f"{request.resource.plural} {request.name}: spec.selector: "
                            "Invalid value: field is immutable")
            if merged.get("spec") != current.get("spec"):
                generation = current.get("metadata", {}).get("generation", 1) + 1
                patch.setdefault("metadata", {})["generation"] = generation
        patch.setdefault("metadata", {})["resourceVersion"] = str(next(self._versions))

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
