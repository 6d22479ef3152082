"""Who may reach a model: the API key engines and routers require, and network peers.

The operator renders `apiKeySecretRef` as the `KVPILOT_API_KEY` environment variable of
every engine and router (a secretKeyRef: the key never appears in an object the operator
writes), and `allowFrom` into the NetworkPolicies of the router and the pools.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator

from kvpilot.operator.api.base import ApiModel
from kvpilot.operator.api.formats import DnsSubdomain, LabelMap, SecretKey
from kvpilot.operator.api.rules import CelRule, validations


class SecretKeyRef(ApiModel):
    """One key of a Secret in the object's namespace."""

    name: DnsSubdomain
    """Name of the Secret."""
    key: SecretKey
    """Key inside the Secret."""


class AuthSpec(ApiModel):
    """How clients authenticate to the model's OpenAI API."""

    api_key_secret_ref: SecretKeyRef | None = None
    """Secret key holding the bearer token engines and routers require (env KVPILOT_API_KEY);
    unset: the API is open to whoever the network lets through."""


class LabelSelector(ApiModel):
    """A label selector by labels only; empty selects everything."""

    match_labels: LabelMap = Field(default_factory=dict)
    """Labels that must all be present with these values."""


class IpBlock(ApiModel):
    """A CIDR range, optionally with holes."""

    cidr: str = Field(max_length=64, pattern=r"^[0-9a-fA-F.:]+/[0-9]{1,3}$")
    """Range allowed, e.g. 10.0.0.0/8."""
    except_: list[str] = Field(default_factory=list, max_length=16, alias="except")
    """Ranges inside cidr that stay denied."""


PEER_RULES = [
    CelRule("has(self.podSelector) || has(self.namespaceSelector) || has(self.ipBlock)",
            "a peer needs podSelector, namespaceSelector or ipBlock: set one"),
    CelRule("!has(self.ipBlock) || !(has(self.podSelector) || has(self.namespaceSelector))",
            "ipBlock cannot be combined with podSelector or namespaceSelector in one peer: "
            "write two peers"),
]


class NetworkPeer(ApiModel):
    """A NetworkPolicy peer: pods (in namespaces) or an IP range allowed to connect."""

    model_config = ConfigDict(json_schema_extra=validations(PEER_RULES))

    pod_selector: LabelSelector | None = None
    """Pods allowed (in the model's namespace, or in the namespaces namespaceSelector picks)."""
    namespace_selector: LabelSelector | None = None
    """Namespaces whose pods (all, or podSelector's) are allowed."""
    ip_block: IpBlock | None = None
    """IP range allowed (traffic from outside the cluster)."""

    @model_validator(mode="after")
    def _one_kind(self) -> NetworkPeer:
        selectors = self.pod_selector is not None or self.namespace_selector is not None
        if not selectors and self.ip_block is None:
            raise ValueError(f"allowFrom peer {self.to_json()}: {PEER_RULES[0].message}")
        if selectors and self.ip_block is not None:
            raise ValueError(f"allowFrom peer {self.to_json()}: {PEER_RULES[1].message}")
        return self
