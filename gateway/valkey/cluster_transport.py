"""The ledger transport for Valkey Cluster: valkey-py's ``ValkeyCluster`` with calls as argument tuples
(``transport.py``).

valkey-py knows the slots, follows redirections and rediscovers the topology; every call of the ledger
names one key (its (rule, tenant)'s hash tag), so it routes like any keyed command. A batch is one
``ClusterPipeline``: one round trip per node that holds some of its keys.

Each batch holds one connection per node it touches for its round trip, so the batches in flight are
bounded (``max_concurrent_calls``): a burst waits for a turn instead of opening connections until the
servers' ``maxclients`` refuse them (cheaper than valkey-py's blocking pool, which locks per command).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

from valkey.asyncio.cluster import ValkeyCluster

from gateway.valkey.transport import SLOT, Arg, Reply, ScriptArgs, ScriptCalls

# A template: the call's arguments with placeholders, and the positions its values go to.
ClusterTemplate = tuple[tuple[Arg | None, ...], tuple[int, ...]]

DEFAULT_MAX_CONCURRENT_CALLS = 64


class ClusterTransport(ScriptCalls, ValkeyCluster):
    """``ValkeyCluster`` speaking the ``ScriptTransport`` protocol; still every command of the client."""

    def __init__(self, *args: Any, max_concurrent_calls: int = DEFAULT_MAX_CONCURRENT_CALLS, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turns = asyncio.Semaphore(max_concurrent_calls)

    def template(self, args: ScriptArgs) -> ClusterTemplate:  # type: ignore[override]
        # "EVALSHA" as a str: valkey-py's cluster routing recognises the command by that name.
        call = ("EVALSHA", self.sha, 1, *args)
        return call, tuple(i for i, arg in enumerate(call) if arg is SLOT)

    def fill(self, template: ClusterTemplate, values: Sequence[bytes]) -> tuple[Arg, ...]:  # type: ignore[override]
        call, slots = template
        args = list(call)
        for position, value in zip(slots, values, strict=True):
            args[position] = value
        return tuple(args)  # type: ignore[arg-type]

    def wire(self, args: Sequence[Arg]) -> tuple[Arg, ...]:
        return ("EVALSHA", self.sha, 1, *args)

    def send_admits(self, wires: Sequence[tuple[Arg, ...]]) -> Awaitable[list[Reply]]:  # type: ignore[override]
        return self._pipelined(wires)

    async def _pipelined(self, wires: Sequence[tuple[Arg, ...]]) -> list[Reply]:  # type: ignore[override]
        async with self._turns:
            pipe = self.pipeline(transaction=False)
            for args in wires:
                # execute_command, not pipe.evalsha(): ClusterPipeline blocks the helper by name but routes
                # EVALSHA by its key like any other keyed command.
                pipe.execute_command(*args)
            return await pipe.execute(raise_on_error=False)

    def scan_keys(self, match: str, type_: str) -> AsyncIterator[bytes]:
        return self.scan_iter(match=match, count=1000, _type=type_)
