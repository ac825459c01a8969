"""How one upstream attempt ended, as passive health (outlier detection) counts it."""

from __future__ import annotations

from enum import IntEnum

from shm.counters import FAIL_5XX, FAIL_CONNECT, FAIL_RESET, FAIL_TIMEOUT


class Outcome(IntEnum):
    """Each failure's value is the worker-row counter word it increments, so recording one is one index.

    A malformed upstream response breaks the exchange like a reset does: report it as ``RESET``.
    """

    OK = 0
    CONNECT = FAIL_CONNECT
    RESET = FAIL_RESET
    TIMEOUT = FAIL_TIMEOUT
    HTTP_5XX = FAIL_5XX
