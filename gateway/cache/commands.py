"""The response cache's Valkey commands, framed in RESP once (gateway/valkey/resp_wire.py encode_command's
output, written out): a worker fills in their arguments with one %-format per command. Pure."""

from __future__ import annotations

from gateway.cache.announce import CHANNEL

_GET = b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n"
# The miss's lookup and claim in one command: GET the entry, and when there is none leave this leader's
# pending marker in its place (NX), for ``PX`` ms at most: the other workers and hosts then wait for it.
_CLAIM = b"*7\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%b\r\n$3\r\nGET\r\n"
# A pending marker starts with a NUL byte: never the first byte of an entry (a msgpack array).
PENDING = b"\x00gridgate-pending:"
# A failed leader removes its marker only if it is still its own (it may have expired and been claimed anew).
_RELEASE = b"if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
_SET = b"*5\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$2\r\nPX\r\n$%d\r\n%b\r\n"
# A fast leader's claim (no GET: it awaits nothing), and the tick's announcements (gateway/cache/announce.py).
_CLAIM_QUIET = b"*6\r\n$3\r\nSET\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n$2\r\nNX\r\n$2\r\nPX\r\n$%d\r\n%b\r\n"
_PUBLISH = b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%b\r\n$%%d\r\n%%b\r\n" % (len(CHANNEL), CHANNEL)
_PING = b"*1\r\n$4\r\nPING\r\n"  # answered once every command written before it was served
