"""How a user's Lua script calls reach Valkey: one protocol, two implementations.

The transport knows the wire, not the script: its user hands it one (``use_script``). The quota ledger
(``gateway.quota.ledger``) is today's only user; it knows the key layout, the script's arguments and what
its replies mean. It turns a script call (the script's ``KEYS[1]`` then its ``ARGV``) into what its client sends,
pipelines a batch of them, reloads the script when the server lost it, and reads the keyspace.

Two implementations, chosen once, where the client is made (``backend.create_client``, by the URL):

- ``RespTransport`` (``resp_transport.py``): one Valkey node through the lean ``RespClient``; a call on
  the wire is RESP bytes, a batch one write on one connection;
- ``ClusterTransport`` (``cluster_transport.py``): Valkey Cluster through valkey-py's ``ValkeyCluster``; a
  call is an argument tuple, a batch one pipeline per node that holds its keys.

The admit of every metered request is the hot call: its wire is prepared once per (rule, tenant) as a
``template`` with per-call slots, and ``fill`` puts in the reservation id and the estimate (one %-format
on the single-node wire). Both implementations are also full command clients (``execute_command``,
``scan_iter``, ``aclose``) for the other users of the backend URL (overlay source, control plane, tests).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from valkey.exceptions import NoScriptError, ValkeyError

Arg = bytes | str | int
# A script call's arguments: KEYS[1] (one key: every call touches one (rule, tenant) and one Cluster slot),
# then ARGV. In a template, SLOT marks an argument each call fills in.
ScriptArgs = Sequence[Arg | None]
SLOT = None
# A call as its client sends it: RESP bytes (single node) or an argument tuple (cluster).
Wire = bytes | tuple[Arg, ...]
# A call prepared once: RESP bytes to %-format, or the argument tuple and the positions of its slots.
Template = bytes | tuple[tuple[Arg | None, ...], tuple[int, ...]]
# What a call answered: the script's value (bytes, int, a list of them), or the error reply in place.
Reply = bytes | int | list[Any] | Exception | None


@dataclass(frozen=True)
class Script:
    """A Lua script and the SHA1 that EVALSHA names it by."""

    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


class UnexpectedReply(ValkeyError, ValueError):
    """The backend answered what the ledger's script cannot have written (a server that is not the
    Valkey the ledger expects, or a broken one): a backend error like any other, never a crash."""


class ScriptTransport(Protocol):
    """A script user's only way to Valkey (the quota ledger's). Errors are valkey-py's exception classes (``backend.BACKEND_ERRORS``);
    timeouts belong to the caller."""

    def use_script(self, script: Script) -> None:
        """The script every call of this transport runs (set once, by its user, before the first call)."""
        ...

    def template(self, args: ScriptArgs) -> Template:
        """A call prepared once: ``args`` with ``SLOT`` where each call differs (filled by ``fill``)."""
        ...

    def fill(self, template: Template, values: Sequence[bytes]) -> Wire:
        """The call ``template`` makes with ``values`` in its slots, in order."""
        ...

    def wire(self, args: Sequence[Arg]) -> Wire:
        """A call made once (no template)."""
        ...

    def send_admits(self, wires: Sequence[Wire]) -> Awaitable[list[Reply]]:
        """One pipelined round trip (per node) for a tick's admits; replies in order, error replies in place,
        NOSCRIPT included (the admit batcher redoes those itself). Single node: a plain future, no task."""
        ...

    async def run_batch(self, wires: Sequence[Wire]) -> list[Reply]:
        """A pipelined batch (settle, extend, cancel, sweep); calls answered NOSCRIPT are redone once after
        a reload (a NOSCRIPT reply means the script did not run, so every mode is safe to redo)."""
        ...

    async def run_one(self, wire: Wire) -> Reply:
        """One call (a report); an error reply is raised."""
        ...

    async def load_script(self) -> None:
        """SCRIPT LOAD (on every primary of a cluster); raises if the server names another SHA."""
        ...

    async def ping(self) -> object:
        """One cheap command: raises unless the backend serves commands (a loading server does not)."""
        ...

    def scan_keys(self, match: str, type_: str) -> AsyncIterator[bytes]:
        """Every key matching the glob ``match`` of that type (on every node of a cluster)."""
        ...

    async def aclose(self) -> None:
        ...


class ScriptCalls:
    """What both transports do the same way on top of their ``_pipelined``: the script, batches that survive
    a lost script cache, one call. A mixin in front of the client class: ``class X(ScriptCalls, Client)``."""

    script: Script | None = None

    if TYPE_CHECKING:  # provided by the transport (``_pipelined``) and by its client class (``script_load``)
        async def _pipelined(self, wires: Sequence[Wire]) -> list[Reply]: ...
        async def script_load(self, script: str) -> str | bytes: ...

    def use_script(self, script: Script) -> None:
        self.script = script

    @property
    def sha(self) -> str:
        if self.script is None:
            raise RuntimeError("no script: the transport's user calls use_script() first")
        return self.script.sha

    async def load_script(self) -> None:
        expected = self.sha
        assert self.script is not None
        sha = await self.script_load(self.script.source)
        if isinstance(sha, bytes):
            sha = sha.decode()
        if sha != expected:  # would mean the server hashes differently: refuse to guess
            raise UnexpectedReply(f"unexpected script sha {sha!r:.80} (expected {expected})")

    async def run_batch(self, wires: Sequence[Wire]) -> list[Reply]:
        if not wires:
            return []
        replies = await self._pipelined(wires)
        lost = [i for i, reply in enumerate(replies) if reply.__class__ is NoScriptError]
        if lost:  # the server restarted, failed over or flushed its scripts
            await self.load_script()
            for i, reply in zip(lost, await self._pipelined([wires[i] for i in lost]), strict=True):
                replies[i] = reply
        return replies

    async def run_one(self, wire: Wire) -> Reply:
        (reply,) = await self.run_batch([wire])
        if isinstance(reply, Exception):
            raise reply
        return reply


class StampedCalls:
    """A transport whose script calls carry a test's clock (``QuotaLedger(clock=...)``, never the gateway's):
    the mode (``ARGV[1]``) goes as ``<mode>@<unix µs>``, which the script takes as now instead of ``TIME``.
    A template stays the argument tuple, so each call is encoded when it is made; the rest is the wrapped
    transport's."""

    def __init__(self, transport: ScriptTransport, clock: Callable[[], float]) -> None:
        self._inner = transport
        self._clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def template(self, args: ScriptArgs) -> Template:
        return tuple(args), ()

    def fill(self, template: Template, values: Sequence[bytes]) -> Wire:
        given = iter(values)
        return self.wire([next(given) if arg is SLOT else arg for arg in template[0]])  # type: ignore[union-attr]

    def wire(self, args: Sequence[Arg]) -> Wire:
        key, mode, *rest = args
        stamp = b"%s@%d" % (mode.encode() if isinstance(mode, str) else mode, round(self._clock() * 1_000_000))
        return self._inner.wire((key, stamp, *rest))
