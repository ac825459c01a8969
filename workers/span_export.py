"""The span exporter of one worker: a bounded queue and a thread that posts batches over OTLP/HTTP
(docs/tracing.md, "Export").

The event loop only appends finished spans to the queue (``submit``: a length check and an ``extend``,
never blocking); a daemon thread wakes every ``flush_interval`` (or when a batch is full), encodes a
batch (gateway/tracing/otlp.py) and posts it with a plain keep-alive ``http.client`` connection under
``timeout``. Nothing waits for the collector: when it is slow or down, the queue fills, new spans are
dropped at ``submit``, and a batch whose post failed is dropped too; both are counted
(``dropped``, exported as ``gridgate_trace_spans_dropped_total``). No retries: a trace is worth less
than the memory and the time a backlog would cost.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
from collections import deque
from urllib.parse import urlsplit

from gateway.config.tracing import Tracing
from gateway.tracing.otlp import OtlpEncoder, Span

log = logging.getLogger("gridgate.tracing")
_LOG_EVERY_S = 60.0  # a failing collector is logged at most once a minute per worker


class SpanExporter:
    def __init__(self, settings: Tracing) -> None:
        url = urlsplit(settings.traces_url())
        self._https = url.scheme == "https"
        self._host = url.hostname or ""
        self._port = url.port or (443 if self._https else 80)
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._headers = {"Content-Type": "application/json", **settings.headers}
        self._timeout = float(settings.timeout)
        self._interval = float(settings.flush_interval)
        self._max = settings.queue_size
        self._batch = settings.batch_size
        self._encoder = OtlpEncoder(settings.service_name)
        self._queue: deque[Span] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._conn: http.client.HTTPConnection | None = None
        self._logged_at = -_LOG_EVERY_S
        # Two counters, each written by one thread only: no lock, no lost increments.
        self.dropped_full = 0  # the event loop's: the queue was full
        self.dropped_failed = 0  # the thread's: their export failed
        self.exported = 0
        self._thread = threading.Thread(target=self._run, name="gridgate-span-export", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self.dropped_full + self.dropped_failed

    def submit(self, spans: list[Span]) -> None:
        """The event loop hands over a request's finished spans; never blocks."""
        queue = self._queue
        if len(queue) + len(spans) > self._max:
            self.dropped_full += len(spans)
            return
        queue.extend(spans)
        if len(queue) >= self._batch:
            self._wake.set()

    def close(self, timeout: float = 2.0) -> None:
        """Export what is queued (within ``timeout``) and stop the thread."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            while self._queue:
                batch = self._take()
                self._post(batch)
            if self._stop:
                if self._conn is not None:
                    self._conn.close()
                return

    def _take(self) -> list[Span]:
        queue, batch = self._queue, []
        for _ in range(min(self._batch, len(queue))):
            batch.append(queue.popleft())
        return batch

    def _post(self, batch: list[Span]) -> None:
        try:
            body = self._encoder.encode(batch)
            conn = self._conn
            if conn is None:
                kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
                conn = self._conn = kind(self._host, self._port, timeout=self._timeout)
            conn.request("POST", self._path, body, self._headers)
            response = conn.getresponse()
            response.read()
            if response.will_close:
                self._close_connection()
            if not 200 <= response.status < 300:
                raise OSError(f"the collector answered {response.status}")
            self.exported += len(batch)
        except Exception as error:  # noqa: BLE001 - any failure drops the batch, never the thread
            self._close_connection()
            self.dropped_failed += len(batch)
            now = time.monotonic()
            if now - self._logged_at >= _LOG_EVERY_S:
                self._logged_at = now
                log.warning("trace export to %s:%d failed (%s): %d spans dropped", self._host, self._port,
                            error, len(batch))

    def _close_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
