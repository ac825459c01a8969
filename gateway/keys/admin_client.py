"""``gridgate keys ...``: the admin API's client and how its answers are shown (docs/keys.md).

The address comes from ``--admin HOST:PORT``, else the config's ``admin.listen`` (``-c FILE``), else
the default ``127.0.0.1:9901``; the token from ``GRIDGATE_ADMIN_TOKEN``. Tables for people, ``--json``
for scripts (the API's own JSON, one document). A failed call is one line naming the status and the
API's message; a key is printed only by ``create`` and ``rotate``, the one time it exists in clear.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlencode

from gateway.keys.record import format_time
from gateway.net import parse_host_port
from gateway.yaml_config import parse_duration

TOKEN_ENV = "GRIDGATE_ADMIN_TOKEN"
DEFAULT_ADMIN = "127.0.0.1:9901"
TIMEOUT_S = 10.0


class AdminCallFailed(Exception):
    """The call did not succeed; the message is one line for stderr."""


def connect_address(listen: str) -> tuple[str, int]:
    """Where to reach a listener bound to ``listen`` (a wildcard address means this host)."""
    host, port = parse_host_port(listen)
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, port


class AdminClient:
    def __init__(self, address: tuple[str, int], token: str | None) -> None:
        self._address = address
        self._token = token

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             query: dict[str, str] | None = None) -> Any:
        """The JSON answer of a 2xx; AdminCallFailed otherwise."""
        if query:
            path += "?" + urlencode({name: value for name, value in query.items() if value is not None})
        headers = {"Accept": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        payload = None if body is None else json.dumps(body).encode()
        if payload is not None:
            headers["Content-Type"] = "application/json"
        host, port = self._address
        connection = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
        try:
            connection.request(method, path, payload, headers)
            response = connection.getresponse()
            data = response.read()
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise AdminCallFailed(f"cannot reach the admin API at {host}:{port}: {reason}") from None
        finally:
            connection.close()
        try:
            answer = json.loads(data) if data else None
        except ValueError:
            answer = None
        if 200 <= response.status < 300:
            return answer
        error = answer.get("error", {}) if isinstance(answer, dict) else {}
        message = error.get("message") or response.reason
        hint = ""
        if response.status == 401 and not self._token:
            hint = f" (set {TOKEN_ENV})"
        raise AdminCallFailed(f"{response.status} {error.get('code', 'error')}: {message}{hint}")


# ----------------------------------------------------------------------------------- building requests


def expires_at(text: str | None, now: float) -> str | None:
    """``--expires``: a duration from now (``30d``) or an RFC 3339 time, as the API takes it."""
    if text is None:
        return None
    try:
        return format_time(int(now + parse_duration(text)))
    except ValueError:
        return text  # an RFC 3339 time (the API checks it and names the field if it is not one)


def create_body(tenant: str, alias: str | None, models: Sequence[str] | None, rpm: int | None,
                expires: str | None, metadata: Sequence[str], now: float | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"tenant": tenant}
    if alias is not None:
        body["alias"] = alias
    if models:
        body["models"] = list(models)
    if rpm is not None:
        body["limits"] = {"requests": [{"window": "1m", "count": rpm}]}
    if expires is not None:
        body["expires_at"] = expires_at(expires, time.time() if now is None else now)
    if metadata:
        body["metadata"] = dict(pair.split("=", 1) for pair in metadata)
    return body


def kid_path(kid: str, action: str | None = None) -> str:
    path = "/admin/keys/" + quote(kid, safe="")
    return path if action is None else f"{path}/{action}"


# ----------------------------------------------------------------------------------- showing answers

LIST_COLUMNS = (("KID", "kid"), ("TENANT", "tenant"), ("ALIAS", "alias"), ("STATUS", "status"),
                ("EXPIRES", "expires_at"), ("LAST USED", "last_used_at"))
_RECORD_FIELDS = ("kid", "tenant", "alias", "status", "models", "limits", "expires_at", "allowed_origins",
                  "metadata", "created_at", "created_by", "updated_at", "last_used_at",
                  "previous_secrets_valid_until", "on_this_host")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The records as an aligned table, one per line."""
    cells = [[title for title, _ in LIST_COLUMNS]]
    cells += [[_cell(row.get(name)) for _, name in LIST_COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(LIST_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
                     for line in cells)


def record_lines(record: dict[str, Any]) -> str:
    """One ``field: value`` line per field of a record."""
    shown = [name for name in _RECORD_FIELDS if name in record]
    width = max(len(name) for name in shown) + 1
    return "\n".join(f"{(name + ':').ljust(width)} {_cell(record[name])}" for name in shown)


def with_key(answer: dict[str, Any]) -> str:
    """A create or rotate answer: the key first, said to be shown this once."""
    return (f"key: {answer['key']}\n"
            "     (shown this once: store it now; the gateway keeps only its digest)\n"
            + record_lines(answer["record"]))
