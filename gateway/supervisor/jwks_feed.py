"""The JWT issuers' key sets as the supervisor keeps them for the whole host (docs/identity.md).

For every ``auth.jwt`` entry with ``jwks_url`` or ``oidc_discovery``, the supervisor, never a worker,
fetches the JWKS (after the discovery document's ``jwks_uri``), on the schedule of
``gateway.identity.jwks_schedule``, and writes each changed, valid set atomically to a file; the workers
get a config whose ``jwks_file`` is that file and follow it (workers/jwt_gate.py). So one host makes
one fetch however many workers it runs, no request ever waits on the IdP, and a worker that starts later
reads the same file. Under systemd the files live in ``$STATE_DIRECTORY`` and a restart while the IdP is
down starts from the last set it wrote.

The IdP down, answering an error or garbage (not JSON, no usable key, a discovery document for another
issuer) leaves the file as it was: the last good set keeps serving. Each outcome is counted
(``gridgate_jwks_fetches_total{issuer,outcome}``) and a change of state is logged once
(``gridgate_jwks_up{issuer}``).

The arbiter calls ``for_workers`` for every config, ``open`` before forking, ``start``/``stop`` on its
loop, ``wanted`` on a worker's ``JwksWanted`` and ``cleanup`` at the end; the feed is a metrics collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gateway.config import Config, JwtIssuer
from gateway.identity.jwks_schedule import FetchSchedule
from gateway.identity.jwt_keys import MAX_KEY_SET_BYTES, KeySetError, parse_key_set

log = logging.getLogger("gridgate.supervisor")

OUTCOMES = ("applied", "unchanged", "failed")
_DISCOVERY = "/.well-known/openid-configuration"
_POLL_S = 0.25


class FetchFailed(Exception):
    """A fetch that produced no usable key set; the message says why in a few words."""


def http_get(url: str, timeout: float) -> tuple[bytes, str | None]:
    """GET ``url`` (blocking: run it in a thread): the body (at most MAX_KEY_SET_BYTES) and Cache-Control."""
    request = urllib.request.Request(url, headers={"Accept": "application/json", "User-Agent": "gridgate-jwks"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310 - http(s) checked in config
            body = answer.read(MAX_KEY_SET_BYTES + 1)
            return body, answer.headers.get("Cache-Control")
    except urllib.error.HTTPError as exc:
        raise FetchFailed(f"{url}: status {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise FetchFailed(f"{url}: {reason}") from None


class IssuerFeed:
    """One fetched issuer: its file, schedule, state and counts."""

    def __init__(self, entry: JwtIssuer, path: str, now: float) -> None:
        self.entry = entry
        self.path = path
        self.schedule = FetchSchedule(entry.refresh, now)
        self.jwks_uri: str | None = entry.jwks_url
        self.fingerprint: str | None = None
        self.keys = 0
        self.up: bool | None = None  # None: not fetched yet
        self.fetched_at: float | None = None  # wall clock of the last good fetch
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self._adopt_existing()

    def _adopt_existing(self) -> None:
        """A set written by an earlier run (``$STATE_DIRECTORY``) serves until the first good fetch."""
        try:
            with open(self.path, "rb") as file:
                keys = parse_key_set(file.read())
        except (OSError, KeySetError):
            return
        self.fingerprint, self.keys = keys.fingerprint, len(keys)

    def fetch(self) -> tuple[bytes, str | None]:
        """Blocking: the discovery document when needed, then the JWKS; FetchFailed if unusable."""
        timeout = float(self.entry.refresh.timeout)
        if self.jwks_uri is None:
            body, _ = http_get(self.entry.issuer.rstrip("/") + _DISCOVERY, timeout)
            try:
                document = json.loads(body)
            except ValueError:
                raise FetchFailed("the discovery document is not JSON") from None
            if not isinstance(document, dict) or not isinstance(document.get("jwks_uri"), str):
                raise FetchFailed("the discovery document has no jwks_uri")
            if document.get("issuer") != self.entry.issuer:
                raise FetchFailed("the discovery document names another issuer")
            self.jwks_uri = document["jwks_uri"]
        return http_get(self.jwks_uri, timeout)  # type: ignore[arg-type]

    def apply(self, body: bytes, cache_control: str | None, now: float) -> str:
        """A fetched body: written when valid and changed; the outcome (raises FetchFailed if invalid)."""
        try:
            keys = parse_key_set(body)
        except KeySetError as exc:
            raise FetchFailed(str(exc)) from None
        self.schedule.fetched(now, cache_control)
        self.keys, self.fetched_at = len(keys), time.time()
        if keys.fingerprint == self.fingerprint:
            return "unchanged"
        _write_atomic(self.path, body)
        self.fingerprint = keys.fingerprint
        return "applied"

    def state(self, up: bool, why: str = "") -> None:
        """Log a change of state once."""
        name = self.entry.name
        if not up and self.up is not False:
            log.warning("auth.jwt %s: key set fetch failed (%s); %s", name, why,
                        "keeping the last good set" if self.fingerprint else "no key set yet: its tokens get 401")
        elif up and self.up is False:
            log.info("auth.jwt %s: key set fetched again (%d keys)", name, self.keys)
        self.up = up


class JwksFeed:
    """Every fetched issuer of one supervisor; see the module docstring."""

    def __init__(self, config: Config) -> None:
        self._dir, self._private = _state_dir()
        self.issuers: dict[str, IssuerFeed] = {}
        self._task: asyncio.Task[None] | None = None
        self._sync(config)

    def _sync(self, config: Config) -> None:
        entries = [entry for entry in (config.auth.jwt if config.auth is not None else [])
                   if entry.jwks_url is not None or entry.oidc_discovery]
        now = time.monotonic()
        kept = {}
        for entry in entries:
            known = self.issuers.get(entry.name)
            if known is not None and known.entry == entry:
                kept[entry.name] = known
            else:
                kept[entry.name] = IssuerFeed(entry, os.path.join(self._dir, f"jwks-{entry.name}.json"), now)
        self.issuers = kept

    def for_workers(self, config: Config) -> Config:
        """``config`` as the workers see it: a fetched issuer's ``jwks_file`` is the file written here."""
        self._sync(config)
        if not self.issuers or config.auth is None:
            return config
        entries = [msgspec.structs.replace(entry, jwks_url=None, oidc_discovery=False,
                                           jwks_file=self.issuers[entry.name].path)
                   if entry.name in self.issuers else entry for entry in config.auth.jwt]
        return msgspec.structs.replace(config, auth=msgspec.structs.replace(config.auth, jwt=entries))

    def open(self) -> None:
        """Before forking: one fetch per issuer, so the first workers start with keys (a failure is
        logged and retried on the loop; the gateway starts anyway, refusing those tokens until then)."""
        if self.issuers:
            asyncio.run(self._fetch_due(time.monotonic()))

    def start(self) -> None:
        """On the supervisor's loop (also when no issuer is fetched yet: a reload may add one)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def wanted(self, name: str) -> None:
        """A worker saw a kid its issuer's set lacks: refetch now unless one was done in the last 30 s."""
        issuer = self.issuers.get(name)
        if issuer is not None and issuer.schedule.unknown_kid(time.monotonic()):
            log.info("auth.jwt %s: a token names an unknown kid: refetching the key set", name)

    def cleanup(self) -> None:
        if self._private:
            shutil.rmtree(self._dir, ignore_errors=True)

    async def _run(self) -> None:
        while True:
            await self._fetch_due(time.monotonic())
            await asyncio.sleep(_POLL_S)

    async def _fetch_due(self, now: float) -> None:
        due = [issuer for issuer in list(self.issuers.values()) if issuer.schedule.is_due(now)]
        await asyncio.gather(*(self._fetch_one(issuer) for issuer in due))

    async def _fetch_one(self, issuer: IssuerFeed) -> None:
        try:
            body, cache_control = await asyncio.to_thread(issuer.fetch)
            outcome = issuer.apply(body, cache_control, time.monotonic())
        except FetchFailed as exc:
            issuer.schedule.failed(time.monotonic())
            if issuer.entry.jwks_url is None:
                issuer.jwks_uri = None  # read the discovery document again next time
            issuer.outcomes["failed"] += 1
            issuer.state(False, str(exc))
            return
        issuer.outcomes[outcome] += 1
        issuer.state(True)

    def collect(self) -> Iterator[Any]:
        if not self.issuers:
            return
        up = GaugeMetricFamily("gridgate_jwks_up", "1 while the issuer's last key set fetch succeeded",
                               labels=["issuer"])
        keys = GaugeMetricFamily("gridgate_jwks_keys", "Keys in the issuer's serving key set", labels=["issuer"])
        age = GaugeMetricFamily("gridgate_jwks_age_seconds", "Seconds since the issuer's key set was last fetched",
                                labels=["issuer"])
        fetches = CounterMetricFamily("gridgate_jwks_fetches", "Key set fetches, by outcome",
                                      labels=["issuer", "outcome"])
        for name, issuer in self.issuers.items():
            up.add_metric([name], 1.0 if issuer.up else 0.0)
            keys.add_metric([name], issuer.keys)
            if issuer.fetched_at is not None:
                age.add_metric([name], max(0.0, time.time() - issuer.fetched_at))
            for outcome, count in issuer.outcomes.items():
                fetches.add_metric([name, outcome], count)
        yield from (up, keys, age, fetches)


def _state_dir() -> tuple[str, bool]:
    """(the directory of the key set files, whether it is private to this run)."""
    state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]  # systemd's StateDirectory=
    if state:
        return state, False
    return tempfile.mkdtemp(prefix="gridgate-jwks-"), True


def _write_atomic(path: str, body: bytes) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as file:
        file.write(body)
    os.replace(temporary, path)
