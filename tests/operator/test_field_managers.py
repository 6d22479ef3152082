"""The emulator's server-side apply, and the operator's pure ownership rules, as tables."""

from __future__ import annotations

import json
from typing import Any

import pytest
from field_managers import Conflicts, apply, conflict_status, entries, update

from kvpilot.operator.api.autoscaling import AutoscalingSpec
from kvpilot.operator.kube.errors import Conflict, conflicts_in
from kvpilot.operator.ownership import conflict_message, foreign, pool_apply, replicas_owner


def obj(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "X", "metadata": {"name": "x", "namespace": "n"},
            "spec": spec}


def owned(o: dict[str, Any]) -> dict[str, set[tuple[str, ...]]]:
    return {f"{e.manager}/{e.operation}": e.fields for e in entries(o)}


def test_apply_creates_and_owns_every_field_it_sets():
    new = apply(None, obj(replicas=1, args=["a"]), "kvpilot", force=False)
    assert new["spec"] == {"replicas": 1, "args": ["a"]}
    assert owned(new) == {"kvpilot/Apply": {("spec", "replicas"), ("spec", "args")}}


def test_equal_values_share_a_field_and_different_ones_conflict_unless_forced():
    base = apply(None, obj(replicas=1), "kvpilot", force=False)
    shared = apply(base, obj(replicas=1), "other", force=False)
    assert owned(shared)["other/Apply"] == owned(shared)["kvpilot/Apply"] == {("spec", "replicas")}
    with pytest.raises(Conflicts) as info:
        apply(base, obj(replicas=2), "other", force=False)
    assert info.value.found == [(("spec", "replicas"), "kvpilot", "")]
    forced = apply(base, obj(replicas=2), "other", force=True)
    assert forced["spec"]["replicas"] == 2
    assert owned(forced) == {"other/Apply": {("spec", "replicas")}}


@pytest.mark.parametrize(("second", "kept"), [
    ({}, {}),  # sole owner stops applying: the field goes
    ({"replicas": 1}, {"replicas": 1}),  # another manager still owns it: it stays
])
def test_a_field_a_manager_stops_applying_is_removed_unless_another_owns_it(second, kept):
    base = apply(None, obj(replicas=1, role="both"), "kvpilot", force=False)
    if second:
        base = apply(base, obj(**second), "handover", force=False)
    after = apply(base, obj(role="both"), "kvpilot", force=False)
    assert after["spec"] == {"role": "both", **kept}


def test_an_update_takes_the_fields_it_changes_so_the_next_apply_conflicts():
    base = apply(None, obj(replicas=1, role="both"), "kvpilot", force=False)
    edited = json.loads(json.dumps(base))
    edited["spec"]["replicas"] = 3
    update(base, edited, "kubectl-edit")
    assert owned(edited) == {"kvpilot/Apply": {("spec", "role")},
                             "kubectl-edit/Update": {("spec", "replicas")}}
    with pytest.raises(Conflicts):
        apply(edited, obj(replicas=1, role="both"), "kvpilot", force=False)
    # A field only the other writer set is never kvpilot's to remove.
    assert apply(edited, obj(role="both"), "kvpilot", force=False)["spec"]["replicas"] == 3


def test_an_unchanged_apply_changes_nothing_not_even_times():
    base = apply(None, obj(replicas=1), "kvpilot", force=False)
    assert apply(base, obj(replicas=1), "kvpilot", force=False) == base


def test_emptying_an_applied_map_removes_its_keys():
    base = apply(None, obj(labels={"a": "1"}), "kvpilot", force=False)
    assert apply(base, obj(labels={}), "kvpilot", force=False)["spec"] == {"labels": {}}


def test_the_conflict_body_is_what_the_operator_reads():
    found = [(("spec", "replicas"), "kube-controller-manager", "scale")]
    body = {"kind": "Status", "code": 409, "reason": "Conflict",
            **conflict_status(found, "kvpilot.dev/v1alpha1")}
    assert conflicts_in(json.dumps(body)) == [
        Conflict(".spec.replicas", "kube-controller-manager")]
    assert conflicts_in('{"kind": "Status", "code": 409, "reason": "AlreadyExists"}') == []


@pytest.mark.parametrize(("autoscaling", "owner"), [
    (None, "kvpilot"),
    (AutoscalingSpec(), "kvpilot-autoscaler"),
    (AutoscalingSpec(mode="external"), "external"),
])
def test_replicas_owner(autoscaling, owner):
    assert replicas_owner(autoscaling) == owner


POOL = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "DecodePool",
        "metadata": {"name": "m-decode", "namespace": "n"}, "spec": {"replicas": 2, "role": "both"}}


@pytest.mark.parametrize(("owner", "stored", "body_replicas", "handover", "first"), [
    ("kvpilot", None, 2, None, True),
    ("kvpilot", 5, 2, None, True),  # static: the model's count is applied (and forced)
    ("external", None, 2, 2, False),  # created with its starting count, then handed over
    ("external", 5, None, 5, True),  # the stored count is handed over, then released
    ("kvpilot-autoscaler", 3, None, 3, True),
])
def test_pool_apply(owner, stored, body_replicas, handover, first):
    plan = pool_apply(POOL, owner, stored)
    assert plan.body["spec"].get("replicas") == body_replicas
    assert plan.body["spec"]["role"] == "both"
    assert (plan.handover["spec"]["replicas"] if plan.handover else None) == handover
    assert plan.handover_first is first


def test_only_foreign_conflicts_are_drift_and_the_message_says_how_to_hand_replicas_over():
    found = [Conflict(".spec.replicas", "kvpilot-handover"), Conflict(".spec.replicas", "hpa")]
    assert foreign(found) == [Conflict(".spec.replicas", "hpa")]
    message = conflict_message("DecodePool", "m-decode", foreign(found))
    assert message.startswith("DecodePool/m-decode: .spec.replicas (set by 'hpa'): kvpilot owns")
    assert "autoscaling.mode: external" in message
    assert "autoscaling" not in conflict_message("Deployment", "d", foreign(found))


@pytest.mark.parametrize(("block", "error"), [
    ({"mode": "external"}, None),
    ({"mode": "external", "minReplicas": 1, "targets": {}}, None),  # the server's defaults
    ({"mode": "external", "maxReplicas": 8}, "autoscaling.maxReplicas=8 with autoscaling.mode="),
    ({"mode": "external", "targets": {"queueDepthPerReplica": 2}}, "autoscaling.targets="),
    ({"mode": "kvpilot", "maxReplicas": 8}, None),
])
def test_external_mode_refuses_kvpilots_policy_fields(block, error):
    if error is None:
        AutoscalingSpec.model_validate(block)
        return
    with pytest.raises(ValueError, match=error):
        AutoscalingSpec.model_validate(block)
