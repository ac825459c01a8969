"""The ledger transport for one Valkey node: ``RespClient`` with calls as RESP bytes (``transport.py``).

A batch is one write on the client's one connection and one future for all its replies, so a tick's
admits cost one ``transport.write`` and no task. A template is the call's RESP encoding with ``$%d\\r\\n%b``
where a slot goes: filling it is one %-format (the fixed parts are escaped, since key names carry ``%``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence

from gateway.valkey.resp import RespClient, encode_command
from gateway.valkey.transport import SLOT, Arg, Reply, ScriptArgs, ScriptCalls

_SLOT_FORMAT = b"$%d\r\n%b\r\n"


class RespTransport(ScriptCalls, RespClient):
    """``RespClient`` speaking the ``ScriptTransport`` protocol; still every command of the client."""

    def template(self, args: ScriptArgs) -> bytes:  # type: ignore[override]
        call = ("EVALSHA", self.sha, 1, *args)
        parts = [b"*%d\r\n" % len(call)]
        for arg in call:
            if arg is SLOT:
                parts.append(_SLOT_FORMAT)
            else:
                parts.append(_bulk_string(arg).replace(b"%", b"%%"))
        return b"".join(parts)

    def fill(self, template: bytes, values: Sequence[bytes]) -> bytes:  # type: ignore[override]
        sized: list[int | bytes] = []
        for value in values:
            sized += (len(value), value)
        return template % tuple(sized)

    def wire(self, args: Sequence[Arg]) -> bytes:
        return encode_command(("EVALSHA", self.sha, 1, *args))

    def send_admits(self, wires: Sequence[bytes]) -> Awaitable[list[Reply]]:  # type: ignore[override]
        return self.send_encoded(b"".join(wires), len(wires))

    async def _pipelined(self, wires: Sequence[bytes]) -> list[Reply]:  # type: ignore[override]
        return await self.send_encoded(b"".join(wires), len(wires))

    def scan_keys(self, match: str, type_: str) -> AsyncIterator[bytes]:
        return self.scan_iter(match=match, count=1000, _type=type_)


def _bulk_string(arg: Arg) -> bytes:
    """One argument as a RESP bulk string (``$<len>\\r\\n<bytes>\\r\\n``)."""
    return encode_command((arg,)).split(b"\r\n", 1)[1]
