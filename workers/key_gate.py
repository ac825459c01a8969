"""Managed keys on the request path (docs/keys.md): the head gate's authentication when the host has a
key table, and the body of ``GET /v1/gridgate/key`` (its model check: workers/model_access.py).

Authentication hashes the presented key once (``gateway.identity.auth.presented_digest``); that digest probes
the YAML keys (a dict) and, on a miss, the host's key table (``gateway.keys.lookup``: one probe in
shared memory, a decode once per change). A key the table knows but refuses is answered 401 with its
reason (``key_blocked``, ``key_revoked``, ``key_expired``).

A keep-alive connection's memo (workers/head_gate.py) holds a YAML key's identity, but only a managed
key's digest: every request on the connection probes the table again, so a block reaches a connection
that is already open within the table's propagation, not at its end.

Only a gate built with a key table comes here: without a store, the head gate runs its YAML-only path,
unchanged.
"""

from __future__ import annotations

from hmac import compare_digest
from time import time
from typing import Any, Protocol

import msgspec

from gateway.identity.auth import Authenticator, KeyIdentity, presented_digest
from gateway.identity.client_cert import VIA as CERTIFICATE
from gateway.keys.answers import key_report, refusal
from gateway.keys.lookup import KeyLookup
from gateway.keys.view import KeyEntry
from gateway.request.headers import RequestHeaders

# A key the table knows but refuses: (code, message) of its 401, and the key's tenant (its access line).
KeyRefusal = tuple[str, str, str]
_ACTIVE = "active"
_encode = msgspec.json.Encoder().encode


class MemoConnection(Protocol):
    # (authorization, x-api-key, the YAML key's identity or the managed key's digest)
    auth_memo: tuple[bytes, bytes, KeyIdentity | bytes] | None


class ManagedKeyGate:
    """One per worker, over the table the supervisor created before fork."""

    __slots__ = ("lookup",)

    def __init__(self, lookup: KeyLookup) -> None:
        self.lookup = lookup

    def authenticate(self, conn: MemoConnection, headers: RequestHeaders,
                     auth: Authenticator) -> KeyIdentity | KeyEntry | KeyRefusal | None:
        """A YAML key's identity, a managed key's entry (active, unexpired, marked used), the refusal of
        a managed key the table refuses, or None (missing or unknown: 401 ``invalid_api_key``)."""
        authorization = headers.authorization or b""
        api_key = headers.api_key or b""
        memo = conn.auth_memo
        if memo is not None:
            memo_authorization, memo_api_key, known = memo
            if compare_digest(memo_authorization, authorization) and compare_digest(memo_api_key, api_key):
                if known.__class__ is KeyIdentity:
                    return known  # type: ignore[return-value]
                # ``admit`` written out for a key in steady use (active, no expiry): one call fewer per request
                entry = self.lookup.use(known)  # type: ignore[arg-type]
                if entry is None or entry.plain:
                    return entry
                return self._dated(entry)
        digest = presented_digest(headers.authorization, headers.api_key)
        if digest is None:
            return None
        identity = auth.identity_of_digest(digest)
        if identity is not None:
            conn.auth_memo = (authorization, api_key, identity)
            return identity
        found = self.admit(digest)
        if found.__class__ is KeyEntry:
            conn.auth_memo = (authorization, api_key, digest)
        return found

    def admit(self, digest: bytes) -> KeyEntry | KeyRefusal | None:
        """The table's entry for ``digest`` if it may be used now (then marked used this minute), its
        refusal if not, None if the table does not hold it."""
        entry = self.lookup.use(digest)  # an active key without expiry (``plain``) comes marked used
        if entry is None or entry.plain:
            return entry
        return self._dated(entry)

    def _dated(self, entry: KeyEntry) -> KeyEntry | KeyRefusal:
        """A key the table holds that is not ``plain``: its refusal (blocked, revoked, expired), else the
        entry, marked used."""
        refused = refusal(entry, time())
        if refused is not None:
            return refused[0], refused[1], entry.tenant
        self.lookup.mark_used(entry)
        return entry


def key_answer(key: KeyIdentity, entry: KeyEntry | None, *, remaining: dict[str, Any] | None = None,
               spend: list[dict[str, Any]] | None = None) -> bytes:
    """The body of ``GET /v1/gridgate/key`` (docs/keys.md). A YAML key (``entry`` None) has no record:
    its tenant, alias and limits, ``"source": "config"``, and nulls. ``spend``: the USD budgets that apply
    to the key this period (``gateway.quota.report.spend_of``), null when none does."""
    if key.via == CERTIFICATE:  # a client certificate's identity (docs/identity.md, "mTLS"): its value
        body = {"object": "gridgate.key", "source": "mtls", "identity": key.via, "subject": key.alias,
                "tenant": key.tenant, "status": _ACTIVE, "models": None, "rule": None, "expires_at": None,
                "limits": None, "remaining": remaining, "spend": spend}
    elif entry is not None and key.kid is not None:  # a managed key (its previous secret's ``via`` says so)
        body = key_report(entry, remaining=remaining, spend=spend)
        body["source"] = "managed"
    elif key.via is not None:  # a JWT's identity (docs/identity.md): its subject, never the token
        grant: Any = entry  # the request's JwtGrant (workers/head_gate.py)
        body = {"object": "gridgate.key", "source": "jwt", "identity": key.via, "subject": key.alias,
                "tenant": key.tenant, "status": _ACTIVE, "models": grant.models, "rule": key.rule,
                "expires_at": int(grant.expires_at),
                "limits": None if key.written is None else key.written.body(), "remaining": remaining,
                "spend": spend}
    else:
        body = {"object": "gridgate.key", "source": "config", "kid": None, "tenant": key.tenant,
                "alias": key.alias, "status": _ACTIVE, "models": None, "expires_at": None,
                "allowed_origins": None, "limits": None if key.written is None else key.written.body(),
                "remaining": remaining,
                "spend": spend}
    return _encode(body)
