"""The data the checks exchange with the runner: a target, the requests sent, the answers read, a result.

Pure data: a check builds :class:`Probe` objects for a :class:`Target` and judges the :class:`Answer`
objects the runner brings back, so every check is testable without a socket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
Credential = Literal["configured", "wrong", "none"]
_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Target:
    """One endpoint of one provider (cluster), for one model of its pool, as the config describes it."""

    cluster: str
    address: str  # host:port, also the Host header (as the workers send it)
    model: str
    context_window: int = 0  # declared in routing.models (0: none declared)
    features: frozenset[str] = frozenset()  # claimed explicitly in routing.models[].features
    surfaces: tuple[str, ...] = ("chat",)  # the APIs the pool serves
    credential_header: str | None = None  # upstream_auth.header, lower case (None: no credential)
    credential: str | None = None  # its value as the workers send it
    tls: bool = False
    sni: str | None = None
    ca_file: str | None = None
    verify: bool = True


@dataclass(frozen=True, slots=True)
class Probe:
    """One request: a JSON body (or raw bytes), extra headers, which credential it carries."""

    method: str
    path: str
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    credential: Credential = "configured"
    estimated_tokens: int = 0  # what it costs when the answer reports no usage


def post(path: str, payload: Any, estimated_tokens: int, headers: tuple[tuple[str, str], ...] = (),
         credential: Credential = "configured") -> Probe:
    return Probe("POST", path, _encode(payload), headers, credential, estimated_tokens)


@dataclass(slots=True)
class Answer:
    """What came back: status, headers (lower-case names), body, timings; ``error`` when none came."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    chunks: list[tuple[float, bytes]] = field(default_factory=list)  # (seconds since sent, body bytes)
    total_s: float = 0.0
    error: str | None = None  # transport failure: refused, timed out, TLS, malformed
    tls: tuple[str, str] | None = None  # (protocol version, server name sent as SNI) over TLS


@dataclass(frozen=True, slots=True)
class Result:
    check: str
    status: str  # PASS | FAIL | SKIPPED
    reason: str
    required: bool
    tokens: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "status": self.status, "reason": self.reason, "required": self.required,
                "tokens": self.tokens, **({"details": self.details} if self.details else {})}
