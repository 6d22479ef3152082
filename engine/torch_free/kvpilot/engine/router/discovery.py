"""Where the engines are: a static list, a re-read file, or Kubernetes EndpointSlices by label selector.

Both give (role, url) pairs; the fleet diffs them against what it knows. In
cluster the router lists EndpointSlices through the API server with the pod's
service-account token (plain httpx; no kubernetes client in the hot image path).
Each pool's Service carries the `kvpilot.dev/role` label, which Kubernetes copies
onto its EndpointSlices; endpoints not ready are left out.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

import httpx

from kvpilot.engine.contracts.router_args import ROLE_LABEL, RouterArgs, parse_instances

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class Discovery(Protocol):
    async def list(self) -> list[tuple[str, str]]:
        """Gives the (role, url) pairs of the engines now."""
        ...


class StaticDiscovery:
    """A fixed list from `--instances`."""

    def __init__(self, text: str) -> None:
        self.pairs = parse_instances(text)

    async def list(self) -> list[tuple[str, str]]:
        return list(self.pairs)


class FileDiscovery:
    """The list in `--instances-file`, re-read on every refresh (kvpilot up rewrites it).

    The writer replaces the file atomically (write, then rename), so a read sees
    the old list or the new one, never half of one. A missing or malformed file
    raises, and the fleet keeps its last list.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    async def list(self) -> list[tuple[str, str]]:
        return parse_instances(self.path.read_text(), allow_empty=True)


def endpoints_from_slices(slices: dict[str, Any], port_name: str) -> list[tuple[str, str]]:
    """Gives (role, url) of every ready endpoint address in an EndpointSliceList."""
    out: list[tuple[str, str]] = []
    for item in slices.get("items") or []:
        role = ((item.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL, "both")
        ports = [p for p in item.get("ports") or [] if p.get("name") == port_name]
        if not ports:
            continue
        port = ports[0]["port"]
        for endpoint in item.get("endpoints") or []:
            # `ready` absent means unknown, which Kubernetes says to treat as ready.
            if (endpoint.get("conditions") or {}).get("ready") is False:
                continue
            for address in endpoint.get("addresses") or []:
                host = f"[{address}]" if ":" in address else address
                out.append((role, f"http://{host}:{port}"))
    return sorted(set(out))


class EndpointSliceDiscovery:
    """EndpointSlices in one namespace matching a label selector."""

    def __init__(self, namespace: str, selector: str, port_name: str,
                 api_server: str | None = None, token: str | None = None,
                 verify: str | bool = True) -> None:
        self.namespace, self.selector, self.port_name = namespace, selector, port_name
        if api_server is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            api_server = f"https://{host}:{port}"
            token_file, ca_file = SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt"
            token = token if token is not None else (
                token_file.read_text().strip() if token_file.exists() else None)
            verify = str(ca_file) if ca_file.exists() else verify
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(base_url=api_server, headers=headers, verify=verify,
                                         timeout=5.0)

    async def list(self) -> list[tuple[str, str]]:
        response = await self._client.get(
            f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices",
            params={"labelSelector": self.selector})
        response.raise_for_status()
        return endpoints_from_slices(response.json(), self.port_name)

    async def aclose(self) -> None:
        await self._client.aclose()


def make_discovery(args: RouterArgs) -> Discovery:
    """Gives the discovery `args.discovery` names."""
    if args.discovery == "kubernetes":
        assert args.selector is not None  # RouterArgs validated it
        return EndpointSliceDiscovery(args.namespace, args.selector, args.port_name)
    if args.instances_file:
        return FileDiscovery(args.instances_file)
    assert args.instances is not None
    return StaticDiscovery(args.instances)
