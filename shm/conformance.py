"""Which providers failed their conformance checks: one word per provider, one writer (the supervisor).

Indexed like :mod:`shm.providers` (the supervisor's stable cluster registry, gateway/metrics/labels.py),
so a reload that reorders clusters keeps each word's meaning. A word is 1 while its provider is left out
of selection as ``nonconformant``, else 0. Words are independent and written whole, so readers need
no seqlock. Storage only: the supervisor decides (gateway/supervisor/conformance.py), workers read.
"""

from __future__ import annotations

WORD_BYTES = 8


class ConformanceFlags:
    def __init__(self, buffer: memoryview, max_providers: int) -> None:
        self.max_providers = max_providers
        self._words = buffer[: max_providers * WORD_BYTES].cast("q")

    @staticmethod
    def required_bytes(max_providers: int) -> int:
        return max_providers * WORD_BYTES

    def mark(self, provider: int, nonconformant: bool) -> None:
        """Supervisor only."""
        if 0 <= provider < self.max_providers:
            self._words[provider] = 1 if nonconformant else 0

    def clear(self) -> None:
        """Supervisor only: every provider back in selection (conformance turned off)."""
        for provider in range(self.max_providers):
            self._words[provider] = 0

    def nonconformant(self, provider: int) -> bool:
        return 0 <= provider < self.max_providers and self._words[provider] != 0
