"""The supervisor's spend-alert sender (docs/pricing.md, "Alerts"): what the workers report over their
status pipes (``publish_alert``) is posted to ``pricing.alerts_webhook``, never from a request path.

Alerts wait in one bounded queue (``QUEUE_SIZE``; past it the newest is dropped and counted) and go
out one at a time, in order. A post that fails (no connection, a timeout, a status other than 2xx) is
tried again after an exponential backoff (``backoff``, doubling, at most ``max_backoff``), up to
``retries`` more times; then the alert counts as failed and the next one goes. So a webhook that is
down loses no alert until its retries run out. Outcomes are counted for
``gridgate_spend_alert_deliveries_total{outcome}``: delivered, failed, dropped.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

import msgspec

from gateway.config.pricing import AlertsWebhook
from gateway.spend.alerts import SpendAlert

log = logging.getLogger("gridgate.supervisor")

QUEUE_SIZE = 10_000
MAX_ALERT_SERIES = 4096  # (tenant, threshold) pairs of gridgate_spend_alerts_total
OUTCOMES = ("delivered", "failed", "dropped")
_MAX_RESPONSE_HEAD = 16 * 1024


class WebhookFailed(Exception):
    """One post did not succeed; the message says why, in a few words."""


async def post_json(hook: AlertsWebhook, body: bytes) -> int:
    """POST ``body`` to the webhook, HTTP/1.1 with ``Connection: close``; the response status, or
    WebhookFailed (connection, TLS, timeout, a status other than 2xx)."""
    parts = urlsplit(hook.url)
    secure = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if secure else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    authority = parts.netloc.rpartition("@")[2]
    headers = [("Host", authority), ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
               ("Connection", "close"), ("User-Agent", "gridgate-spend-alerts"), *hook.headers.items()]
    head = f"POST {target} HTTP/1.1\r\n" + "".join(f"{name}: {value}\r\n" for name, value in headers) + "\r\n"
    writer = None
    try:
        async with asyncio.timeout(float(hook.timeout)):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=ssl.create_default_context() if secure else None,
                server_hostname=host if secure else None)
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
            status_line = await reader.readuntil(b"\r\n")
    except TimeoutError:
        raise WebhookFailed(f"no answer within {float(hook.timeout):g}s") from None
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ssl.SSLError) as exc:
        raise WebhookFailed(type(exc).__name__ + (f": {exc.strerror}" if getattr(exc, "strerror", None) else "")) \
            from None
    finally:
        if writer is not None:
            writer.close()
    fields = status_line.split(b" ", 2)
    if len(fields) < 2 or not fields[0].startswith(b"HTTP/1.") or not fields[1].isdigit():
        raise WebhookFailed("not an HTTP response")
    status = int(fields[1])
    if not 200 <= status < 300:
        raise WebhookFailed(f"status {status}")
    return status


def alert_body(alert: SpendAlert) -> bytes:
    """The JSON the webhook receives: the alert's fields and ``"type": "gridgate.spend_alert"``."""
    return msgspec.json.encode({"type": "gridgate.spend_alert", **msgspec.structs.asdict(alert)})


class AlertSender:
    """One per supervisor. ``webhook`` returns the running config's webhook; without one an alert is
    logged and nothing else. ``post`` and ``sleep`` are the I/O (tests shorten nothing: they configure
    short backoffs)."""

    def __init__(self, webhook: Callable[[], AlertsWebhook | None], post: Callable = post_json,
                 sleep: Callable[[float], object] = asyncio.sleep, queue_size: int = QUEUE_SIZE) -> None:
        self._webhook = webhook
        self._post = post
        self._sleep = sleep
        self._queue: deque[SpendAlert] = deque()
        self._queue_size = queue_size
        self._task: asyncio.Task[None] | None = None
        self.counts = dict.fromkeys(OUTCOMES, 0)
        self.worker_drops = 0  # alerts a worker's outbox could not keep (summed from their reports)
        # Alerts reported, per (tenant, threshold): gridgate_spend_alerts_total, webhook or not. Bounded:
        # past MAX_ALERT_SERIES pairs, new ones count under tenant "other".
        self.reported: dict[tuple[str, str], int] = {}

    def submit(self, alert: SpendAlert) -> None:
        """An alert a worker reported; never blocks."""
        log.info("spend alert: tenant %s, %s budget %s reached %g (%d of %d nano-USD)", alert.tenant, alert.scope,
                 alert.budget, alert.threshold, alert.spent_nusd, alert.limit_nusd)
        series = (alert.tenant, f"{alert.threshold:g}")
        if series not in self.reported and len(self.reported) >= MAX_ALERT_SERIES:
            series = ("other", series[1])
        self.reported[series] = self.reported.get(series, 0) + 1
        if self._webhook() is None:
            return
        if len(self._queue) >= self._queue_size:
            self.counts["dropped"] += 1
            return
        self._queue.append(alert)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def _run(self) -> None:
        while self._queue:
            hook = self._webhook()
            if hook is None:  # a reload removed the webhook: what waits goes nowhere
                self.counts["dropped"] += len(self._queue)
                self._queue.clear()
                return
            alert = self._queue[0]
            delivered = await self._deliver(alert)
            self._queue.popleft()
            self.counts["delivered" if delivered else "failed"] += 1

    async def _deliver(self, alert: SpendAlert) -> bool:
        body = alert_body(alert)
        delay = None
        attempt = 0
        while True:
            hook = self._webhook()
            if hook is None:
                return False
            try:
                await self._post(hook, body)
                return True
            except WebhookFailed as exc:
                if attempt >= hook.retries:
                    log.warning("spend alert for tenant %s not delivered after %d attempts: %s", alert.tenant,
                                attempt + 1, exc)
                    return False
                delay = float(hook.backoff) if delay is None else min(delay * 2, float(hook.max_backoff))
                attempt += 1
                await self._sleep(delay)

    async def close(self, timeout_s: float = 2.0) -> None:
        """At shutdown: a post in progress may finish; what still waits is counted as dropped."""
        if self._task is not None and not self._task.done():
            try:
                async with asyncio.timeout(timeout_s):
                    await asyncio.shield(self._task)
            except TimeoutError:
                self._task.cancel()
        self.counts["dropped"] += len(self._queue)
        self._queue.clear()
