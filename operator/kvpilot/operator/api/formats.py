"""Kubernetes value formats as API types: quantities, env-var names, label keys and values.

Each format is one regular expression, used as the schema `pattern` of a value (the API
server rejects the object at `kubectl apply`) and by a pydantic validator (the operator and
`kvpilot up` reject it with the same message naming the fix). Map keys have no schema
pattern in OpenAPI: only the pydantic side checks them (see `_keys`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Annotated

from pydantic import AfterValidator, Field, WithJsonSchema

# Kubernetes resource.Quantity without a sign: resources are never negative.
QUANTITY = r"^[+]?([0-9]+([.][0-9]*)?|[.][0-9]+)([eE][-+]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$"
_SUFFIX = {"": 1, "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000),
           "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


@dataclass(frozen=True)
class Format:
    """A string format: its pattern and what to tell a user whose value breaks it."""

    pattern: str
    message: str

    def check(self, value: str) -> None:
        """Raises ValueError naming `value` and the fix unless it matches the pattern."""
        if not re.search(self.pattern, value):
            raise ValueError(f"{value!r}: {self.message}")


ENV_NAME = Format(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                  "env names are letters, digits, '_', '-' or '.', not starting with a digit "
                  "(no '=' or spaces): rename the variable")
LABEL_KEY = Format(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                   r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$",
                   "keys are [DNS-subdomain/]name, the name at most 63 letters, digits, '-', "
                   "'_' or '.', alphanumeric at both ends: rename the key")
LABEL_VALUE = Format(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$",
                     "label values are at most 63 letters, digits, '-', '_' or '.', "
                     "alphanumeric at both ends: change the value")
DNS_SUBDOMAIN = Format(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
                       "object names are lowercase letters, digits, '-' and '.', starting and "
                       "ending alphanumeric: use the name of an existing object")


def _matching(fmt: Format) -> AfterValidator:
    def check(value: str) -> str:
        fmt.check(value)
        return value

    return AfterValidator(check)


DnsSubdomain = Annotated[str, Field(min_length=1, max_length=253, json_schema_extra={
    "pattern": DNS_SUBDOMAIN.pattern}), _matching(DNS_SUBDOMAIN)]
"""The name of an object in the namespace (a Secret, a ServiceAccount, a claim)."""
SecretKey = Annotated[str, Field(min_length=1, max_length=253, json_schema_extra={
    "pattern": r"^[-._a-zA-Z0-9]+$"}), _matching(Format(
        r"^[-._a-zA-Z0-9]+$", "Secret keys hold letters, digits, '-', '_' and '.': use the "
        "key the Secret has"))]
"""A key of a Secret's data."""


def parse_quantity(value: str | int) -> Fraction:
    """Gives the exact value of a Kubernetes quantity ('500m', '64Gi', '1e3', 8)."""
    if isinstance(value, int):
        return Fraction(value)
    match = re.fullmatch(QUANTITY, value)
    if match is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity: write e.g. 500m, 8, 64Gi or "
                         "1e9 (no sign, no B: 64GB is 64G or 64Gi)")
    number, suffix = match.group(1), match.group(3) or ""
    if suffix[:1] in "eE" and suffix:
        return Fraction(number) * Fraction(10) ** int(suffix[1:])
    return Fraction(number) * _SUFFIX[suffix]


def _quantity(value: str | int) -> str | int:
    if isinstance(value, bool) or (isinstance(value, int) and value < 0):
        raise ValueError(f"{value!r} is not a Kubernetes quantity: resources are never negative")
    parse_quantity(value)
    return value


Quantity = Annotated[str | int, AfterValidator(_quantity), WithJsonSchema(
    {"x-kubernetes-int-or-string": True, "pattern": QUANTITY, "minimum": 0})]
"""A resource amount: a non-negative integer or a quantity string such as 500m or 64Gi."""


def _keys(fmt: Format, max_items: int) -> tuple[AfterValidator, object]:
    """Gives the metadata of a map type whose keys must match `fmt` and that holds at most
    `max_items` entries.

    Only pydantic checks the keys (the operator ends the object Degraded, `kvpilot up`
    refuses it): OpenAPI cannot bound a map key's length, so the API server would estimate
    a CEL regex over the keys at an unbounded cost and refuse the whole CRD.
    """
    def check(mapping: Mapping[str, object]) -> Mapping[str, object]:
        for key in mapping:
            fmt.check(key)
        return mapping

    return AfterValidator(check), Field(max_length=max_items)


LabelValue = Annotated[str, Field(json_schema_extra={"pattern": LABEL_VALUE.pattern}),
                       _matching(LABEL_VALUE)]
"""A label value (also a node-selector value)."""
EnvMap = Annotated[dict[str, str], *_keys(ENV_NAME, 128)]
"""Environment variables by name."""
LabelMap = Annotated[dict[str, LabelValue], *_keys(LABEL_KEY, 64)]
"""Kubernetes labels (also node selectors)."""
AnnotationMap = Annotated[dict[str, str], *_keys(LABEL_KEY, 64)]
"""Kubernetes annotations."""
