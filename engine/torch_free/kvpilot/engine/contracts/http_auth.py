"""Who may call which HTTP path of an engine or a router; torch- and framework-free.

Two credentials, two kinds of path:

- user paths (`/v1/*`, and `/metrics` with `--metrics-require-api-key`) take the API key
  (`--api-key`, else `$KVPILOT_API_KEY`) as `Authorization: Bearer KEY`;
- fleet-internal paths (`/kv_events`: an engine's GET, a router's POST; a router's
  `/response_store`, which its peers read) take the fleet
  secret's signature (`X-Kvpilot-Fleet-Auth`, see `fleet_secret`). The API key does not
  open them: KV events tell which prompts are cached, which a user must not learn. A
  fleet with an API key but no secret guards them with the key instead, so an API key
  never leaves them open;
- `/health`, `/ready` (probes) and anything else stay open; `/metrics` too unless asked.

Both apps wrap `HttpAuth.refusal` in their own error format; the router sends engines
`HttpAuth.user_headers` (its API key: the operator gives a fleet one key) and signs its
`/kv_events` reads with `fleet_headers`.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvpilot.engine.contracts.fleet_secret import (
    FLEET_AUTH_HEADER,
    MAX_CLOCK_SKEW_S,
    FleetSecret,
)

FLEET_PATHS = ("/kv_events", "/response_store")
USER_PREFIX = "/v1/"
METRICS_PATH = "/metrics"


@dataclass(frozen=True)
class HttpAuth:
    """The credentials an engine or router checks on its HTTP paths."""

    api_key: str | None = field(default=None, repr=False)
    fleet: FleetSecret = field(default_factory=FleetSecret)
    metrics_require_api_key: bool = False
    # without a secret or a key: whether fleet paths stay open (`kvpilot serve --insecure-kv`;
    # `kvpilot serve` closes them otherwise, in-process test apps leave them open)
    open_fleet_paths: bool = True

    def kind(self, path: str) -> str:
        """Gives `fleet`, `user` or `open`: which credential `path` needs."""
        if path in FLEET_PATHS:
            return "fleet"
        if path.startswith(USER_PREFIX) or (path == METRICS_PATH and self.metrics_require_api_key):
            return "user"
        return "open"

    def refusal(self, method: str, path: str, query: str, headers: Mapping[str, str],
                body: bytes = b"") -> str | None:
        """Gives why a request is refused (the 401's message), or None when it may pass.

        `headers` is case-insensitive (Starlette's) or lower-cased.
        """
        kind = self.kind(path)
        if kind == "fleet" and self.fleet.enabled:
            target = f"{path}?{query}" if query else path
            if self.fleet.verify(headers.get(FLEET_AUTH_HEADER.lower()), method, target, body):
                return None
            return (f"{path} is fleet-internal: send '{FLEET_AUTH_HEADER}' signed with the "
                    "fleet's secret (--fleet-secret-file); it is missing, wrong or more than "
                    f"{MAX_CLOCK_SKEW_S}s off this host's clock")
        if kind == "fleet" and self.api_key is None and not self.open_fleet_paths:
            return (f"{path} is fleet-internal and this server has no --fleet-secret-file: "
                    "give it and its router one, or start it with --insecure-kv to serve "
                    f"{path} to anyone")
        if kind == "open" or self.api_key is None:
            return None
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110 11.1): clients send `bearer` too
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              self.api_key.encode()):
            return None
        return "missing or wrong API key: send the header 'Authorization: Bearer <key>'"

    def user_headers(self) -> dict[str, str]:
        """Gives the headers that open an engine's user paths (and, without a secret, its
        fleet paths) to this router."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def fleet_headers(self, method: str, target: str, body: bytes = b"") -> dict[str, str]:
        """Gives the headers that open a fleet-internal path (`target` = path?query)."""
        if not self.fleet.enabled:
            return {}
        return {FLEET_AUTH_HEADER: self.fleet.sign(method, target, body)}
