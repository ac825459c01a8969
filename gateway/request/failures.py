"""Why an upstream attempt failed: one typed vocabulary for the pool, the retry logic, passive health
and the error the client finally sees. Each failure travels with a detail in plain words
("connection refused"), never library internals."""

from __future__ import annotations

from enum import IntEnum


class Failure(IntEnum):
    REFUSED = 1  # the connection could not be opened (refused, unreachable, TLS handshake)
    CONNECT_TIMEOUT = 2  # the connection did not open within connect_timeout
    RESET = 3  # the provider closed or reset the connection
    TIMEOUT = 4  # no response bytes within the read (or first-byte) deadline
    MALFORMED = 5  # the response was not valid HTTP/1.1
    CLIENT_STALLED = 7  # the client read nothing of the response for timeouts.client_stall

    @property
    def code(self) -> str:
        """The error code of the access log and of a stream's error event."""
        return _CODES[self]


_CODES = {failure: f"upstream_{failure.name.lower()}" for failure in Failure}
_CODES[Failure.CLIENT_STALLED] = "client_stalled"

