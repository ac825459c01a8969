"""Whether a request may be answered from the cache, and its key. Pure: body bytes and header values in,
a verdict out.

The key is a digest (xxhash128) of: the tenant (unless ``tenants: shared``), the API surface, the model
after aliases, the answer-changing request headers of the API (Anthropic's version and betas), and the
body's members in a canonical form (decoded, the members every API ignores for the answer dropped, the
rest re-encoded with sorted keys, so spacing and member order do not matter). ``key_fields`` narrows the
body part to the members it names. The list of ignored members per API is ``IGNORED_MEMBERS``
(docs/cache.md, "The key").
"""

from __future__ import annotations

from typing import Any

import msgspec
import xxhash

from gateway.config.cache import Cache

# Body members that do not change the answer, per API surface (``Surface.name``): who asks (user,
# safety identifiers, metadata) and whether the provider keeps it (store). ``model`` is left out
# too: the model after aliases goes into the key in its place.
_WHO_ASKS = frozenset(("model", "user", "metadata", "store", "safety_identifier", "prompt_cache_key"))
IGNORED_MEMBERS: dict[str, frozenset[str]] = {
    "chat_completions": _WHO_ASKS,
    "completions": _WHO_ASKS,
    "embeddings": frozenset(("model", "user")),
    "responses": _WHO_ASKS | {"background"},
    "messages": frozenset(("model", "metadata")),
}
CACHEABLE_SURFACES = frozenset(IGNORED_MEMBERS)
# Request headers that change the answer, per surface: their values join the key.
ANSWER_HEADERS: dict[str, tuple[bytes, ...]] = {"messages": (b"anthropic-version", b"anthropic-beta")}
# Surfaces whose answer is deterministic whatever the body says.
_ALWAYS_DETERMINISTIC = frozenset(("embeddings",))

BYPASS = "bypass"  # the request says not to use the cache, or is not cacheable
_decode = msgspec.json.decode
_encode = msgspec.json.Encoder(order="sorted").encode
_KEY_PREFIX = b"gridgate:cache:"
_digest = xxhash.xxh3_128_digest
_int_digest = xxhash.xxh3_128_intdigest
_NUMBERS = (int, float)  # a temperature's types (bool is neither: ``.__class__`` is tested, not isinstance)


class CacheKey(msgspec.Struct, frozen=True, gc=False):
    """A cacheable request's key in Valkey (``key``), whether its answer is a stream, the
    ``request_digest`` it was made for (0: none), and the key's own 16-byte digest (``raw``: the hex
    part of ``key``; the host index places the key by it)."""

    key: bytes
    stream: bool
    digest: int = 0
    raw: bytes = b""


def request_seed(surface: str, tenant: str | None, model: str) -> int:
    """The 64-bit seed of ``request_digest`` for one tenant, API and resolved model (a worker keeps them)."""
    tenant_part, model_part = (tenant or "").encode(), model.encode()
    return xxhash.xxh3_64_intdigest(b"%d:%b%d:%b%d:%b" % (len(tenant_part), tenant_part, len(surface), surface.encode(),
                                                        len(model_part), model_part))


def request_digest(seed: int, surface: str, body: bytes, headers: dict[bytes, bytes]) -> int:
    """The request as sent (``seed``: its tenant, API and resolved model; its answer headers; the body's raw
    bytes), as one 128-bit integer: equal for two requests whose bytes are equal, so a worker that made a
    request's key once (``cache_key``: the body decoded, re-encoded sorted) can reuse it for the same bytes
    again. Not the key: two spellings of one request have different digests and the same key."""
    names = ANSWER_HEADERS.get(surface)
    if names is not None:
        values = [headers.get(name, b"") for name in names]
        body = b"".join(b"%d:%b" % (len(value), value) for value in values) + body
    return _int_digest(body, seed)


def request_bypasses(cache_control: bytes | None, cache_header: bytes | None) -> bool:
    """``Cache-Control: no-store`` or ``x-gridgate-cache: bypass``: neither read nor stored."""
    if cache_header is not None and cache_header.strip().lower() == b"bypass":
        return True
    return cache_control is not None and b"no-store" in cache_control.lower()


def is_deterministic(surface: str, body: dict[str, Any]) -> bool:
    """Temperature 0 or a seed (embeddings always): the same request gets the same answer."""
    if surface in _ALWAYS_DETERMINISTIC:
        return True
    if body.get("seed") is not None:
        return True
    temperature = body.get("temperature")
    return temperature.__class__ in _NUMBERS and temperature == 0


def key_prefix(cache: Cache, surface: str, tenant: str | None, model: str) -> bytes:
    """The key's material before the request's own part: the tenant (unless ``tenants: shared``), the API
    and the resolved model, each length-prefixed (no two part lists make the same bytes). A worker keeps
    it per (tenant, API, model), beside ``request_seed``."""
    tenant_part = b"" if cache.tenants == "shared" else (tenant or "").encode()
    model_part = model.encode()
    return b"%d:%b%d:%b%d:%b" % (len(tenant_part), tenant_part, len(surface), surface.encode(), len(model_part),
                                 model_part)


def key_parts(cache: Cache, surface: str, tenant: str | None, model: str) -> tuple[int, bytes]:
    """``request_seed``'s and ``key_prefix``'s, for a worker to keep per (tenant, API, model)."""
    return request_seed(surface, tenant, model), key_prefix(cache, surface, tenant, model)


def cache_key(cache: Cache, surface: str, tenant: str | None, model: str, body: bytes,
              headers: dict[bytes, bytes], digest: int = 0, prefix: bytes | None = None) -> CacheKey | None:
    """The request's key, or None when it is not cacheable (another API, a body that is not a JSON
    object, not deterministic while ``only_deterministic``). ``headers``: the request's headers by
    lowercase name (only ``ANSWER_HEADERS`` are read); ``prefix``: ``key_prefix``'s, when the caller kept it."""
    ignored = IGNORED_MEMBERS.get(surface)
    if ignored is None:
        return None
    try:
        members = _decode(body)
    except msgspec.DecodeError:
        return None
    if members.__class__ is not dict:
        return None
    # Deterministic (``is_deterministic``, inline: every miss and every first hit asks): a seed, or a
    # temperature of 0 (an int or a float: not False, not "0"); embeddings always.
    if cache.only_deterministic and surface not in _ALWAYS_DETERMINISTIC and members.get("seed") is None:
        temperature = members.get("temperature")
        if temperature.__class__ not in _NUMBERS or temperature != 0:
            return None
    fields = cache.key_fields
    if fields is None:
        kept = members  # freshly decoded, ours: the ignored members present (usually `model` alone) go
        for name in ignored.intersection(members):
            del kept[name]
    else:
        kept = {name: members[name] for name in fields if name in members}
    material = key_prefix(cache, surface, tenant, model) if prefix is None else prefix
    names = ANSWER_HEADERS.get(surface)
    if names is not None:
        for name in names:
            value = headers.get(name, b"")
            material += b"%d:%b" % (len(value), value)
    raw = _digest(material + _encode(kept))  # the body's canonical form last
    return CacheKey(_KEY_PREFIX + raw.hex().encode(), members.get("stream") is True, digest, raw)
