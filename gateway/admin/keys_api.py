"""The managed-keys pages of the admin API (docs/keys.md): ``/admin/keys...`` and ``/admin/audit``.

Each handler takes the parsed request and the authenticated caller and returns an ``AdminResponse``.
The token check, scopes and routing live in ``pages.AdminApp``; the store in ``gateway.keys.store``.
Answers: 400 naming the field, 404 unknown kid, 409 a change the key's state forbids (a revoked key),
503 when the store does not answer (nothing was changed that the caller was not told about: a retry
of the same call is safe, except a create, which makes a new key each time).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from typing import Any, Protocol

from gateway.admin.pages import AdminResponse, error_response, json_response
from gateway.admin.tokens import Caller
from gateway.identity.keyformat import is_kid, redact
from gateway.keys.record import (
    NAME_PATTERN,
    BodyProblem,
    CreateKey,
    KeyRecord,
    PatchKey,
    Rotate,
    decode_body,
    parse_time,
    public_record,
)
from gateway.keys.store import KeyConflict, KeyNotFound, KeyStore, audit_entry, is_stream_id
from gateway.query_params import QueryProblem, single_params
from gateway.yaml_config import StrictStruct

log = logging.getLogger("gridgate.admin")

DEFAULT_PAGE = 100
MAX_PAGE = 1000
_KID_PATH = re.compile(r"/admin/keys/([^/]+)(?:/(block|unblock|revoke|rotate))?")
_STATUSES = ("active", "blocked", "revoked")


class KeyHost(Protocol):
    """What the supervisor provides the key pages."""

    def store(self) -> KeyStore | None:
        """The running config's store; None when managed keys are off."""
        ...

    def on_this_host(self, record: KeyRecord) -> dict[str, Any] | None:
        """What this host's table holds for the key (its status, how many secrets), or None."""
        ...

    def backend_errors(self) -> tuple[type[BaseException], ...]: ...


class KeysApi:
    """The key pages over the supervisor's ``KeyHost``."""

    def __init__(self, host: KeyHost, clock: Callable[[], float] = time.time) -> None:
        self._host = host
        self._clock = clock

    @staticmethod
    def scope_for(method: str) -> str:
        return "keys:read" if method in ("GET", "HEAD") else "keys:write"

    @staticmethod
    def allowed_methods(path: str) -> str | None:
        """The Allow header of ``path``, or None when it is not a key page."""
        if path == "/admin/keys":
            return "GET, HEAD, POST"
        if path == "/admin/audit":
            return "GET, HEAD"
        match = _KID_PATH.fullmatch(path)
        if match is None:
            return None
        return "POST" if match.group(2) else "GET, HEAD, PATCH"

    async def handle(self, method: str, path: str, query: dict[str, list[str]], body: bytes,
                     caller: Caller) -> AdminResponse:
        store = self._host.store()
        if store is None:
            return error_response(404, "managed keys are off: they need an auth block and a store "
                                       "(a quota block, or auth.store)", "managed_keys_disabled")
        try:
            return await self._route(store, method, path, query, body, caller)
        except (BodyProblem, QueryProblem) as exc:
            return error_response(400, redact(str(exc)), "invalid_request")
        except KeyNotFound as exc:
            return error_response(404, f"no key with kid {exc}" if is_kid(str(exc)) else
                                  "no key with that kid (a kid is 12 characters of A-Z a-z 0-9)", "key_not_found")
        except KeyConflict as exc:
            return error_response(409, str(exc), "conflict")
        except self._host.backend_errors() as exc:
            log.warning("admin: key store unavailable: %s", type(exc).__name__)
            return error_response(503, "the key store is unavailable; nothing was changed by this call "
                                       "unless it says so, retry it", "key_store_unavailable", "server_error")

    async def note(self, action: str, actor: str, changed: dict[str, Any]) -> None:
        """An audit entry that changes no key (a console sign-in, sign-out, session expiry), when managed
        keys are on; a store that cannot take it is logged, never raised (the sign-in goes on)."""
        store = self._host.store()
        if store is None:
            return
        try:
            await store.note(action, actor, changed)
        except self._host.backend_errors() as exc:
            log.warning("admin: key store unavailable, %s by %s not in the audit log: %s", action, actor,
                        type(exc).__name__)

    async def _route(self, store: KeyStore, method: str, path: str, query: dict[str, list[str]], body: bytes,
                     caller: Caller) -> AdminResponse:
        now = self._clock()
        if path == "/admin/audit":
            return await self._audit(store, query)
        if path == "/admin/keys":
            if method == "POST":
                _no_query(query)
                created = decode_body(body, CreateKey)
                if created.expires_at is not None and parse_time(created.expires_at, "expires_at") <= now:
                    raise BodyProblem("expires_at: is in the past")
                key, record = await store.create(created, caller.name, now)
                log.info("admin: %s created key %s for tenant %s", caller.name, record.kid, record.tenant)
                return json_response(201, {"key": key, "record": await store.public(record, now)})
            return await self._list(store, query, now)
        match = _KID_PATH.fullmatch(path)
        assert match is not None  # allowed_methods() checked the path
        kid, action = match.group(1), match.group(2)
        if not is_kid(kid):
            raise KeyNotFound(kid)
        _no_query(query)
        if action is None and method in ("GET", "HEAD"):
            record = await store.get(kid)
            if record is None:
                raise KeyNotFound(kid)
            return json_response(200, {**await store.public(record, now), "on_this_host": self._host.on_this_host(record)})
        if action is None:  # PATCH
            changes = decode_body(body, PatchKey).changes()
            if not changes:
                raise BodyProblem("body: name at least one of alias, models, limits, expires_at, "
                                  "allowed_origins, metadata")
            record = await store.patch(kid, changes, caller.name, now)
            log.info("admin: %s changed %s of key %s", caller.name, ", ".join(sorted(changes)), kid)
            return json_response(200, await store.public(record, now))
        if action == "rotate":
            grace = decode_body(body, Rotate)
            key, record = await store.rotate(kid, grace.seconds(), caller.name, now)
            log.info("admin: %s rotated key %s (grace %s)", caller.name, kid, grace.grace)
            return json_response(200, {"key": key, "record": await store.public(record, now)})
        decode_body(body, _Empty)
        record = await store.set_status(kid, action, caller.name, now)
        log.info("admin: %s: %s key %s", caller.name, action, kid)
        return json_response(200, await store.public(record, now))

    async def _list(self, store: KeyStore, query: dict[str, list[str]], now: float) -> AdminResponse:
        params = single_params(query, ("tenant", "alias", "status", "cursor", "limit"))
        for name in ("tenant", "alias"):
            if name in params and NAME_PATTERN.fullmatch(params[name]) is None:
                raise QueryProblem(f"{name}: must be 1..64 characters of A-Z a-z 0-9 . _ -")
        if "status" in params and params["status"] not in _STATUSES:
            raise QueryProblem(f"status: must be one of {', '.join(_STATUSES)}")
        if "cursor" in params and not is_kid(params["cursor"]):
            raise QueryProblem("cursor: not a cursor this API returned")
        limit = _limit(params.get("limit"))
        records, cursor = await store.page(tenant=params.get("tenant"), alias=params.get("alias"),
                                           status=params.get("status"), cursor=params.get("cursor"), limit=limit)
        used = await store.last_used([record.kid for record in records])
        data = [public_record(record, last, now) for record, last in zip(records, used, strict=True)]
        return json_response(200, {"object": "list", "data": data, "next_cursor": cursor})

    async def _audit(self, store: KeyStore, query: dict[str, list[str]]) -> AdminResponse:
        params = single_params(query, ("since", "limit"))
        since = params.get("since")
        if since is not None and not is_stream_id(since):
            raise QueryProblem("since: must be an audit entry id (such as 1767225600000-0)")
        entries, oldest = await store.audit(since, _limit(params.get("limit")))
        return json_response(200, {
            "object": "list",
            "data": [audit_entry(entry) for entry in entries],
            "next_since": entries[-1].id if entries else since,
            "oldest_id": oldest,  # older entries were trimmed (the log keeps about the last 100,000)
        })


class _Empty(StrictStruct):
    """The body of block, unblock and revoke: nothing (or an empty object)."""




def _no_query(query: dict[str, list[str]]) -> None:
    if query:
        raise QueryProblem(f"{next(iter(query))}: this page takes no query parameters")


def _limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_PAGE
    if not text.isdigit() or not 1 <= int(text) <= MAX_PAGE:
        raise QueryProblem(f"limit: must be an integer 1..{MAX_PAGE}")
    return int(text)

