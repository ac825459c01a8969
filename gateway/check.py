"""A loaded config checked against what it names: the overlay, quota rules, secrets, TLS and log files.

The schema (gateway.config) judges the file alone; these checks read other files and the
environment. Two callers, one set of rules:

- the supervisor, before it forks and on every reload: :func:`validate_deployment` raises for
  what would stop the gateway from serving, and answers the overlay it read;
- ``gridgate check``: :func:`check_problems` also reports overlay candidates whose cluster this
  gateway lacks (the gateway tolerates them and skips those candidates at run time:
  docs/routing.md#usable-providers; a config under review should not carry them) and quota rules whose
  ``match.model`` glob matches no model of the overlay it reads (the overlay changes while the gateway
  runs, so the gateway itself never refuses a config for that), and can skip the environment for CI.

Imports stay on the pure floors (overlay, quota rules): nothing from the data plane.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping

from gateway.config import Config, ConfigError, ServerTls
from gateway.http.tls import load_problem, server_tls_context
from gateway.identity.jwt_keys import KeySetError, parse_key_set
from gateway.net import client_tls_context
from gateway.overlay.contract import OverlayRejected
from gateway.overlay.snapshot import Snapshot
from gateway.overlay.valkey_source import source_problems
from gateway.overlay.watch import load_inline_overlay, load_overlay_file
from gateway.quota.rules import model_glob_problems, rules_from_config, validate_rules


def validate_deployment(config: Config) -> Snapshot | None:
    """Raise ConfigError, one line per problem, when the gateway could not serve this config; else the
    overlay it read (None when the config names none), for the supervisor's warnings."""
    problems, snapshot = _problems_and_overlay(config, os.environ)
    if problems:
        raise ConfigError(problems)
    return snapshot


def check_problems(config: Config, *, environ: Mapping[str, str] | None = os.environ) -> list[str]:
    """Everything ``gridgate check`` reports; ``environ=None`` skips the secrets (``--no-env``)."""
    problems, snapshot = _problems_and_overlay(config, environ)
    problems += jwt_problems(config)  # not at start: a key file the supervisor writes may not exist yet
    if snapshot is not None:
        problems += unconfigured_cluster_problems(config, snapshot)
        problems += model_problems(config, snapshot)
        if config.quota is not None:  # a model glob matching no model of this overlay (docs/limits.md)
            problems += model_glob_problems(rules_from_config(config.quota),
                                            [name for _, name in snapshot.capability_keys])
    return problems


def load_overlay_snapshot(config: Config) -> Snapshot | None:
    """The overlay the config names (file or inline), or None; raises ConfigError naming the field.

    A Valkey ``overlay_source`` is not read here: its ``overlay_file`` fallback is, when given."""
    path = config.overlay_path()
    try:
        if path is not None:
            return load_overlay_file(path, config.routing.expected_overlay_scope)
        if config.routing.candidates is not None:
            return load_inline_overlay(config.routing.candidates, config.routing.expected_overlay_scope)
    except OverlayRejected as exc:
        raise ConfigError([f"routing.overlay_file: {path}: {exc}" if path else f"routing.candidates: {exc}"]) from None
    return None


def _problems_and_overlay(config: Config, environ: Mapping[str, str] | None) -> tuple[list[str], Snapshot | None]:
    problems: list[str] = []
    if config.quota is not None:
        problems += validate_rules(rules_from_config(config.quota))
    if environ is not None:
        problems += secret_problems(config, environ)
    if config.server_tls is not None:
        problems += server_tls_problems(config, config.server_tls)
    problems += upstream_ca_problems(config)
    problems += access_log_problems(config)
    source = config.routing.overlay_source
    if source is not None:
        cache_file = None if source.cache_file is None else config.file_path(source.cache_file)
        problems += source_problems(source.url, cache_file)
    snapshot = None
    path = config.overlay_path()
    try:
        if path is not None:
            snapshot = load_overlay_file(path, config.routing.expected_overlay_scope)
        elif config.routing.candidates is not None:
            snapshot = load_inline_overlay(config.routing.candidates, config.routing.expected_overlay_scope)
    except OverlayRejected as exc:
        problems.append(f"routing.overlay_file: {path}: {exc}" if path else f"routing.candidates: {exc}")
    return problems, snapshot


def secret_problems(config: Config, environ: Mapping[str, str]) -> list[str]:
    """Each ``upstream_auth.value_env`` must be set and usable in a header value."""
    problems = []
    for index, cluster in enumerate(config.clusters):
        auth = cluster.upstream_auth
        if auth is None:
            continue
        field = f"clusters[{index}].upstream_auth.value_env"
        secret = environ.get(auth.value_env)
        if secret is None:
            problems.append(f"{field}: environment variable {auth.value_env} is not set")
        elif not all(32 <= ord(ch) < 127 for ch in secret):
            problems.append(f"{field}: {auth.value_env} holds characters not allowed in a header value")
    return problems


def server_tls_problems(config: Config, tls: ServerTls) -> list[str]:
    """The certificate chain and key must load as the listener will load them, and so must the client
    CA bundle and CRL file of ``client_auth``."""
    cert, key = config.file_path(tls.cert_file), config.file_path(tls.key_file)
    files = [("cert_file", cert, b"-----BEGIN CERTIFICATE-----", "certificate"),
             ("key_file", key, b"PRIVATE KEY-----", "private key")]
    clients = tls.client_auth
    trust = None if clients is None else clients.trust(config.file_path)
    if trust is not None:
        files.append(("client_auth.ca_file", trust.ca_file, b"-----BEGIN CERTIFICATE-----", "certificate"))
        if trust.crl_file is not None:
            files.append(("client_auth.crl_file", trust.crl_file, b"-----BEGIN X509 CRL-----", "CRL"))
    problems = [problem for field, path, marker, what in files
                if (problem := _pem_file_problem(f"server_tls.{field}", path, marker, what)) is not None]
    if problems:
        return problems
    try:
        server_tls_context(cert, key)  # exactly as the listener loads them
    except OSError as exc:
        return [f"server_tls: {cert} and {key} do not load as a certificate and its key: {load_problem(exc)}"]
    if trust is None:
        return []
    try:
        server_tls_context(cert, key, trust._replace(crl_file=None))
    except OSError as exc:
        return [f"server_tls.client_auth.ca_file: {trust.ca_file} does not load as CA certificates: "
                f"{load_problem(exc)}"]
    try:
        server_tls_context(cert, key, trust)
    except OSError as exc:
        return [f"server_tls.client_auth.crl_file: {trust.crl_file} does not load as CRLs: {load_problem(exc)}"]
    return []


def jwt_problems(config: Config) -> list[str]:
    """An ``auth.jwt`` entry's key file must hold a usable key set; a ``rule_claim`` needs quota rules
    to name. (Unknown algorithms, an issuer without a key source and a missing tenant claim are the
    schema's: the config does not load.)"""
    problems: list[str] = []
    for index, entry in enumerate(config.auth.jwt if config.auth is not None else []):
        if entry.jwks_file is not None:
            path = config.file_path(entry.jwks_file)
            try:
                with open(path, "rb") as file:
                    parse_key_set(file.read())
            except OSError as exc:
                problems.append(f"auth.jwt[{index}].jwks_file: cannot read {path}: {exc.strerror}")
            except KeySetError as exc:
                problems.append(f"auth.jwt[{index}].jwks_file: {path}: {exc}")
        if entry.rule_claim is not None and config.quota is None:
            problems.append(f"auth.jwt[{index}].rule_claim: names a quota rule, but there is no quota block")
    return problems


def _pem_file_problem(field: str, path: str, marker: bytes, what: str) -> str | None:
    try:
        with open(path, "rb") as handle:
            content = handle.read()
    except OSError as exc:
        return f"{field}: cannot read {path}: {exc.strerror}"
    return None if marker in content else f"{field}: {path} holds no PEM {what}"


def access_log_problems(config: Config) -> list[str]:
    """An access-log file must be writable (or creatable) by the gateway's user."""
    settings = config.access_log
    if not settings.enabled or settings.path == "-":
        return []
    path = config.file_path(settings.path)
    directory = os.path.dirname(path) or "."
    if os.path.isdir(path):
        return [f"access_log.path: {path} is a directory"]
    if os.path.exists(path):
        return [] if os.access(path, os.W_OK) else [f"access_log.path: {path} is not writable"]
    if not os.path.isdir(directory):
        return [f"access_log.path: directory {directory} does not exist"]
    if not os.access(directory, os.W_OK | os.X_OK):
        return [f"access_log.path: cannot create {path}: directory {directory} is not writable"]
    return []


def upstream_ca_problems(config: Config) -> list[str]:
    """Each cluster's ``tls.ca_file`` must load, as the workers and the health prober load it."""
    problems = []
    for index, cluster in enumerate(config.clusters):
        if isinstance(cluster.tls, bool) or cluster.tls.ca_file is None:
            continue
        try:
            client_tls_context(ca_file=cluster.tls.ca_file)
        except (OSError, ssl.SSLError) as exc:
            reason = getattr(exc, "reason", None) or exc.strerror or exc
            problems.append(f"clusters[{index}].tls.ca_file: cannot load {cluster.tls.ca_file}: {reason}")
    return problems


def unconfigured_cluster_problems(config: Config, snapshot: Snapshot) -> list[str]:
    """One line per overlay cluster this config lacks, naming the first candidate that uses it."""
    configured = {cluster.name for cluster in config.clusters}
    field = "routing.overlay_file" if config.routing.overlay_file is not None else "routing.candidates"
    where = f"{config.overlay_path()}: " if config.routing.overlay_file is not None else ""
    problems = []
    for name in snapshot.clusters:
        if name in configured:
            continue
        users = [cand.position for cand in snapshot.candidates if cand.cluster == name]
        more = f" (and {len(users) - 1} more candidates)" if len(users) > 1 else ""
        problems.append(f"{field}: {where}candidates[{users[0]}].cluster: {name!r} is not a configured "
                        f"cluster{more}; such candidates are never selected")
    return problems


def model_problems(config: Config, snapshot: Snapshot) -> list[str]:
    """The ``models`` block against the overlay (docs/models.md): an alias must not shadow a model the
    overlay serves (requests for that model would silently go elsewhere), and every model an alias or a
    chain names must be served by the overlay (or, in a chain, be an alias). The gateway tolerates an
    unserved one at run time (a chain skips it), like an unconfigured cluster, but a config under
    review should not carry it."""
    models = config.models
    served = set(snapshot.model_names)
    problems = []
    for name in models.aliases:
        field = f"models.aliases[{json.dumps(name)}]"
        if name in served:
            problems.append(f"{field}: shadows the model {name!r} the overlay serves; rename the alias")
        target = models.target(name)
        if target not in served:
            problems.append(f"{field}: target {target!r} is not a model the overlay serves")
    for model, fallback in models.fallbacks.items():
        field = f"models.fallbacks[{json.dumps(model)}]"
        if model not in served and model not in models.aliases:
            problems.append(f"{field}: {model!r} is neither a model the overlay serves nor an alias")
        for index, entry in enumerate(fallback.chain):
            if entry not in served and entry not in models.aliases:
                problems.append(f"{field}.chain[{index}]: unknown model {entry!r} (neither a model the overlay "
                                "serves nor an alias)")
    return problems
