"""The response cache's fast paths (docs/cache.md, "What it costs"): the same bytes find their key without
making it again; a hit's admission from a worker-held block takes one request slot and nothing else."""

from __future__ import annotations

from gateway.cache.key import cache_key, request_digest, request_seed
from gateway.config.cache import Cache
from gateway.quota.lease import Allowance, Lease, LeaseReservation, request_allowance

_BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0}'


def _digest(surface: str = "chat_completions", tenant: str | None = "a", model: str = "m", body: bytes = _BODY,
            headers: dict[bytes, bytes] | None = None) -> int:
    return request_digest(request_seed(surface, tenant, model), surface, body, headers or {})


def test_the_request_digest_is_the_bytes_as_sent() -> None:
    assert _digest() == _digest()
    # Anything that could change the key changes the digest: tenant, API, model, the body's bytes, the
    # answer headers of the API; a tenant's name and a model's never run into each other.
    others = {_digest(tenant="b"), _digest(tenant=None), _digest(surface="completions"), _digest(model="m2"),
              _digest(body=_BODY.replace(b"hi", b"ho")), _digest(tenant="am", model=""),
              _digest(surface="messages"), _digest(surface="messages", headers={b"anthropic-version": b"1"}),
              _digest(surface="messages", headers={b"anthropic-beta": b"1"})}
    assert len(others) == 9 and _digest() not in others
    # Headers other APIs do not read leave theirs alone.
    assert _digest(headers={b"anthropic-version": b"1"}) == _digest()


def test_a_respelled_request_has_another_digest_and_the_same_key() -> None:
    cache = Cache(enabled=True)
    respelled = b'{ "temperature": 0, "messages": [{"content": "hi", "role": "user"}], "model": "m" }'
    first = cache_key(cache, "chat_completions", "a", "m", _BODY, {}, _digest())
    second = cache_key(cache, "chat_completions", "a", "m", respelled, {}, _digest(body=respelled))
    assert first is not None and second is not None
    assert first.key == second.key and first.digest != second.digest


def _block(slots: int, closes_at: float = 10.0) -> Lease:
    reservation = LeaseReservation(b"z", b"p", b"id|100|60:1", 100)
    return Lease(reservation, Allowance(100, 5000, 0, 20.0), closes_at, slots=request_allowance(slots, 60, 0, 20.0))


def test_a_hit_takes_one_request_slot_and_no_tokens_and_holds_nothing_in_flight() -> None:
    block = _block(slots=2)
    assert block.take_hit(1.0) and block.take_hit(1.0)
    assert (block.slots.committed, block.tokens.committed, block.in_flight, block.taken) == (2, 0, 0, 2)
    assert not block.take_hit(1.0) and not block.closed  # no slot left: `take` decides (and closes it)
    assert not block.take(10, now=1.0) and block.closed
    late = _block(slots=5, closes_at=2.0)
    assert not late.take_hit(2.0) and late.slots.committed == 0  # past its deadline: nothing taken
    closed = _block(slots=5)
    closed.close()
    assert not closed.take_hit(1.0)


def test_a_hit_is_left_to_take_where_take_would_not_admit_it() -> None:
    # A block whose tokens an overage committed past its capacity: `take` of 0 tokens closes it (the
    # ledger decides), so the hit is not admitted from it either.
    over = _block(slots=5)
    assert over.take(90, now=1.0)
    over.end(90, 150)  # charged more than its estimate: 150 committed of 100
    assert not over.take_hit(1.0) and over.slots.committed == 1
    assert not over.take(0, now=1.0) and over.closed
    # Within capacity, a hit leaves the tokens committed as they are and the next size sees a 0 estimate.
    fine = _block(slots=5)
    assert fine.take(40, now=1.0) and fine.take_hit(1.0)
    assert (fine.tokens.committed, fine.last_estimate, fine.slots.committed, fine.in_flight) == (40, 0, 2, 1)
