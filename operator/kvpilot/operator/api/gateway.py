"""The `inferencePool` block of an InferenceModel: its engines behind a Gateway API gateway.

kvpilot renders an InferencePool (`inference.networking.k8s.io/v1`, the Gateway API inference
extension) that selects the model's serving engine pods, so a gateway with an endpoint picker
(llm-d's, kgateway's, the extension's reference picker) can route to them directly. The
picker itself is the user's: it is deployed with the gateway and named here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvpilot.operator.api.base import ApiModel


class EndpointPickerRef(ApiModel):
    """The endpoint picker Service the gateway asks which engine serves each request."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the picker's Service in the InferenceModel's namespace."""
    port: int = Field(ge=1, le=65535)
    """The Service port of the picker's ext-proc gRPC endpoint (9002 in the upstream charts)."""
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"
    """What the gateway does while the picker does not answer: route anyway, or refuse."""


class InferencePoolSpec(ApiModel):
    """Render an InferencePool selecting this model's engines (needs the operator's
    --inference-pool flag and the InferencePool CRD installed)."""

    endpoint_picker: EndpointPickerRef
    """The picker the InferencePool's endpointPickerRef names (required by the API)."""
