"""An operator stopped mid-reconcile, restarted: no duplicate, no renamed child, nothing lost.

The first operator is stopped deterministically: a hook lets exactly AFTER children of the
InferenceModel be applied, holds every other apply (the pools' handlers never get to
theirs), and signals the test, which then stops that operator. A deliberately broken
restart (children renamed) must fail the same check.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kube_api import ApiServer
from operator_harness import IMS, NAMESPACE, eventually, running_operator
from test_reconcile_kmock import IM_PATH, tiny

from kvpilot.operator.kube.client import Kube
from kvpilot.operator.render import children as render_children

AFTER = 4
EXPECTED = [
    ("ConfigMap", "rs-engine", 1), ("DecodePool", "rs-decode", 1),
    ("Deployment", "rs-decode", 1), ("Deployment", "rs-prefill", 1),
    ("Deployment", "rs-router", 1), ("NetworkPolicy", "rs-decode", 1),
    ("NetworkPolicy", "rs-prefill", 1), ("NetworkPolicy", "rs-router", 1),
    ("PodDisruptionBudget", "rs-decode", 1), ("PodDisruptionBudget", "rs-prefill", 1),
    ("PrefillPool", "rs-prefill", 1), ("Role", "rs-router", 1), ("RoleBinding", "rs-router", 1),
    ("Secret", "rs-fleet", 1), ("Service", "rs-decode", 1), ("Service", "rs-prefill", 1),
    ("Service", "rs-router", 1), ("ServiceAccount", "rs-router", 1),
]


def census(api: ApiServer) -> list[tuple[str, str, int]]:
    """Gives (kind, name, owner-reference count) of every live object the operator made."""
    out = []
    for key in ("kvpilot.dev/v1alpha1/decodepools", "kvpilot.dev/v1alpha1/prefillpools",
                "apps/v1/deployments", "v1/services", "v1/configmaps", "v1/serviceaccounts",
                "v1/secrets", "rbac.authorization.k8s.io/v1/roles",
                "rbac.authorization.k8s.io/v1/rolebindings", "policy/v1/poddisruptionbudgets",
                "networking.k8s.io/v1/networkpolicies"):
        for obj in api.live(key, NAMESPACE):
            out.append((obj["kind"], obj["metadata"]["name"],
                        len(obj["metadata"].get("ownerReferences", []))))
    return sorted(out)


@contextmanager
def stop_after(monkeypatch: pytest.MonkeyPatch, applied: int,
               reached: asyncio.Event) -> Iterator[None]:
    """Lets `applied` InferenceModel children be applied, then holds every apply."""
    original = Kube.apply
    count = 0

    async def apply(self: Kube, obj: Any, **options: Any) -> Any:
        nonlocal count
        refs = obj["metadata"].get("ownerReferences") or [{}]
        if refs[0].get("kind") == "InferenceModel" and count < applied:
            count += 1
            result = await original(self, obj, **options)
            if count == applied:
                reached.set()
            return result
        await asyncio.Event().wait()  # held until the operator is stopped

    with monkeypatch.context() as patch:
        patch.setattr(Kube, "apply", apply)
        yield


async def restart_mid_reconcile(api: ApiServer, client: Any, monkeypatch: pytest.MonkeyPatch,
                                rename_on_restart: bool) -> None:
    await client.post(IM_PATH, json=tiny("rs", servingMode="disaggregated", prefill={}))
    reached = asyncio.Event()
    with stop_after(monkeypatch, AFTER, reached):
        async with running_operator():
            await asyncio.wait_for(reached.wait(), 30)
    partial = census(api)
    assert [kind for kind, _, _ in partial if kind != "Secret"] == \
        ["ConfigMap", "DecodePool", "PrefillPool", "ServiceAccount"]
    with monkeypatch.context() as patch:
        if rename_on_restart:  # the broken variant: the restarted operator renames pools
            patch.setattr(render_children, "pool_name", lambda m, r: f"{m}-{r}-v2")
        async with running_operator():
            await eventually(lambda: (o := api.get(IMS, NAMESPACE, "rs"))
                             and o.get("status", {}).get("observedGeneration") == 1,
                             what="status after restart")
            # as many children as expected (never more, unless duplicated or renamed)
            await eventually(lambda: len(census(api)) >= len(EXPECTED), what="all children",
                             timeout=120)
            full = census(api)
    assert set(partial) <= set(full), "children made before the restart were replaced"
    assert full == EXPECTED, f"the children are not the expected ones: {full}"
    async with running_operator():  # a third start (resume) changes nothing
        await eventually(lambda: True)
        assert census(api) == full


async def test_restart_mid_reconcile_leaves_no_duplicates(api, client, monkeypatch):
    await restart_mid_reconcile(api, client, monkeypatch, rename_on_restart=False)


async def test_a_restart_that_renames_children_fails_the_check(api, client, monkeypatch):
    # Renamed pools mean new ones are made and the old ones pruned: the subset check or the
    # census fails, whichever the timing reaches first.
    with pytest.raises(AssertionError,
                       match=r"made before the restart were replaced|not the expected ones"):
        await restart_mid_reconcile(api, client, monkeypatch, rename_on_restart=True)
