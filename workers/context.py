"""What the supervisor hands a worker process at fork time."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.config import Config


@dataclass(slots=True)
class WorkerContext:
    config: Config
    # Row index in shared memory; unique among the live workers (old and new generations included).
    slot: int
    # Incremented on every config reload; lets the supervisor tell old workers from new ones.
    generation: int
    # The shared-memory segment created before fork (shm.segment.Segment), or None in unit tests.
    segment: Any
    # Write end of the worker -> supervisor status pipe (JSON lines, see workers/status.py).
    status_fd: int
    # URL of the quota backend (the embedded Valkey's URL when quota.backend.kind == embedded).
    quota_url: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
