"""The managed-keys part of the configuration: ``admin.tokens`` and ``auth.store`` (docs/keys.md).

Split from :mod:`gateway.config` (which re-exports every name here) so each schema module stays
small; the rules are the same: strict Structs, a range for every number, errors naming the field.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from gateway.identity.auth import is_key_digest
from gateway.net import parse_host_port
from gateway.valkey.urls import url_problem
from gateway.yaml_config import StrictStruct

AdminScope = Literal["keys:read", "keys:write", "spend:read", "quota:read"]
ADMIN_SCOPES: tuple[str, ...] = ("keys:read", "keys:write", "spend:read", "quota:read")


class AdminToken(StrictStruct):
    """A bearer token for the admin API: its name (in the audit log), digest and scopes."""

    name: str
    key: str  # sha256:<64 hex> of the token (`gridgate keys hash`)
    scopes: list[AdminScope] = []

    def __post_init__(self) -> None:
        if not self.name.strip() or len(self.name) > 64 or not self.name.isprintable():
            raise ValueError("name: must be 1..64 printable characters")
        if not is_key_digest(self.key):
            raise ValueError("key: must be 'sha256:<64 lowercase hex>' (see `gridgate keys hash`)")


class KeyStoreBackend(StrictStruct):
    """``auth.store``: where managed keys live when there is no ``quota`` block."""

    kind: Literal["embedded", "valkey"] = "embedded"
    url: str | None = None
    # embedded only: where the bundled Valkey keeps its append-only file (as quota.backend.data_dir).
    data_dir: str | None = None

    def __post_init__(self) -> None:
        check_backend_url(self.kind, self.url)
        if self.kind != "valkey" and self.url is not None:
            raise ValueError("url: only with kind valkey (kind embedded runs the bundled Valkey)")


def check_backend_url(kind: str, url: str | None) -> None:
    """A Valkey backend's ``url`` (the quota's and the managed keys' store): ValueError names the field."""
    if kind == "valkey":
        if not url:
            raise ValueError("url: must be set with kind valkey (e.g. valkey://host:6379/0)")
        problem = url_problem(url)
        if problem:
            raise ValueError(f"url: {problem}")


def is_loopback(address: str) -> bool:
    host, _ = parse_host_port(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def keys_checks(tokens: list[AdminToken], admin_listen: str) -> list[str]:
    """Cross-field checks of the admin tokens; each problem names its field."""
    problems = []
    names = [token.name for token in tokens]
    for index, name in enumerate(names):
        if names.index(name) != index:
            problems.append(f"admin.tokens[{index}].name: duplicate token name {name!r}")
    digests = [token.key for token in tokens]
    for index, digest in enumerate(digests):
        if digests.index(digest) != index:
            problems.append(f"admin.tokens[{index}].key: the same token as admin.tokens[{digests.index(digest)}]")
    try:
        if not tokens and not is_loopback(admin_listen):
            problems.append("admin.listen: off loopback the admin listener needs admin.tokens (it would "
                            "serve every admin page to anyone who can reach it)")
    except ValueError:
        pass  # the address itself is reported by its own check
    return problems
