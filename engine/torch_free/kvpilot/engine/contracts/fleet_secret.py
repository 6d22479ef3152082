"""The fleet secret: one per InferenceModel, shared by its engines and routers; torch-free.

It authenticates the fleet-internal paths and salts the block hashes. Each use gets its
own key, HMAC-SHA256(secret, label), so no use hands out another's key:

- KV-agent connections: a mutual challenge-response (`kv_auth`) keyed by `kv_key`;
- fleet-internal HTTP (an engine's `GET /kv_events`, a router's `POST /kv_events`): the
  header `X-Kvpilot-Fleet-Auth: <unix seconds>.<hex HMAC(http key, method, path and
  query, seconds, SHA-256 of the body)>`, accepted within `MAX_CLOCK_SKEW_S`;
- block hashes: `block_hash_salt` keys their blake2b (`block_hash`), so a fleet's hashes
  say nothing to whoever lacks the secret, and two fleets never share one.

The operator keeps the secret in a Secret (key `secret`) mounted at `FLEET_SECRET_PATH`
and renders `--fleet-secret-file` into engines and routers; `kvpilot up` writes a 0600
file. Without one (`FleetSecret()`) the fleet runs as before: open internal paths,
unsalted hashes; the KV handshake still runs, keyed by a key everyone can derive.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

FLEET_SECRET_PATH = "/var/run/kvpilot/fleet/secret"
FLEET_SECRET_KEY = "secret"  # the Secret's data key the operator mounts
FLEET_AUTH_HEADER = "X-Kvpilot-Fleet-Auth"
MIN_SECRET_BYTES = 16
GENERATED_SECRET_BYTES = 32
MAX_CLOCK_SKEW_S = 300  # how old (or early) a signed request may be
UNAUTHENTICATED_WARNING = ("no --fleet-secret-file: KV-agent connections and /kv_events are "
                           "unauthenticated and block hashes unsalted; pass a file holding "
                           "hex text, e.g. from `openssl rand -hex 32`")
INSECURE_ROLE_REFUSAL = (
    "--role {role} without --fleet-secret-file: its KV port would answer anyone who "
    "computes an HMAC with the empty key; pass --fleet-secret-file PATH (hex text, e.g. "
    "`openssl rand -hex 32 > PATH`, the same file for the fleet's engines and router), or "
    "--insecure-kv to run it open")


@dataclass(frozen=True)
class FleetSecret:
    """The secret's bytes (empty: none configured) and the keys derived from them."""

    secret: bytes = field(default=b"", repr=False)

    @classmethod
    def from_file(cls, path: str | None) -> FleetSecret:
        """Gives the secret in the file at `path` (hex text, whitespace stripped); none for None.

        Raises ValueError naming the flag, the value and the fix.
        """
        if path is None:
            return cls()
        try:
            text = Path(path).read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"fleet_secret_file={path!r} cannot be read ({exc}): point "
                             "--fleet-secret-file at a readable file holding hex text") from exc
        try:
            secret = bytes.fromhex(text)
        except ValueError as exc:
            raise ValueError(f"fleet_secret_file={path!r} does not hold hex text: write e.g. "
                             "the output of `openssl rand -hex 32` into it") from exc
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"fleet_secret_file={path!r} holds {len(secret)} bytes: a fleet "
                             f"secret needs at least {MIN_SECRET_BYTES} (`openssl rand -hex 32`)")
        return cls(secret)

    @classmethod
    def generate(cls) -> FleetSecret:
        """Gives a new random secret."""
        return cls(secrets.token_bytes(GENERATED_SECRET_BYTES))

    @property
    def enabled(self) -> bool:
        """Whether a secret is configured (internal paths authenticated, hashes salted)."""
        return bool(self.secret)

    def _key(self, label: str) -> bytes:
        return hmac.new(self.secret, label.encode(), hashlib.sha256).digest()

    @property
    def block_hash_salt(self) -> bytes:
        """Gives the key of the block hashes' blake2b; empty (unsalted) without a secret."""
        return self._key("kvpilot block-hash salt") if self.enabled else b""

    @property
    def kv_key(self) -> bytes:
        """Gives the key of the KV agents' challenge-response."""
        return self._key("kvpilot kv-agent auth")

    def sign(self, method: str, target: str, body: bytes = b"", now: float | None = None) -> str:
        """Gives the `X-Kvpilot-Fleet-Auth` value of a request to `target` (path?query)."""
        seconds = int(time.time() if now is None else now)
        return f"{seconds}.{self._mac(method, target, seconds, body)}"

    def verify(self, header: str | None, method: str, target: str, body: bytes = b"",
               now: float | None = None) -> bool:
        """Gives whether `header` signs this request, made at most MAX_CLOCK_SKEW_S from now."""
        if not header:
            return False
        seconds_text, _, mac = header.partition(".")
        if not seconds_text.isdigit() or len(seconds_text) > 12:
            return False
        seconds = int(seconds_text)
        if abs((time.time() if now is None else now) - seconds) > MAX_CLOCK_SKEW_S:
            return False
        expected = self._mac(method, target, seconds, body)
        return hmac.compare_digest(mac.encode(), expected.encode())

    def _mac(self, method: str, target: str, seconds: int, body: bytes) -> str:
        message = "\n".join((method.upper(), target, str(seconds),
                             hashlib.sha256(body).hexdigest()))
        return hmac.new(self._key("kvpilot http auth"), message.encode(),
                        hashlib.sha256).hexdigest()
