from __future__ import annotations

import hashlib
import time

import pytest

from gateway.identity.auth import Authenticator, hash_api_key, is_key_digest

KEY_A = "sk-team-a-0123456789"
KEY_B = "sk-team-b-9876543210"


@pytest.fixture
def auth() -> Authenticator:
    return Authenticator([("team-a", hash_api_key(KEY_A)), ("team-b", hash_api_key(KEY_B))])


def test_hash_is_sha256_config_form() -> None:
    digest = hash_api_key(KEY_A)
    assert digest == "sha256:" + hashlib.sha256(KEY_A.encode()).hexdigest()
    assert is_key_digest(digest)


def test_hash_strips_exactly_one_trailing_newline_like_stdin() -> None:
    assert hash_api_key(KEY_A + "\n") == hash_api_key(KEY_A)
    assert hash_api_key(KEY_A + "\r\n") == hash_api_key(KEY_A)
    assert hash_api_key(KEY_A + "\n\n") != hash_api_key(KEY_A)
    assert hash_api_key(" " + KEY_A) != hash_api_key(KEY_A)


def test_bearer_token_identifies_tenant(auth: Authenticator) -> None:
    assert auth.authenticate(b"Bearer " + KEY_A.encode(), None) == "team-a"
    assert auth.authenticate(b"bearer " + KEY_B.encode(), None) == "team-b"
    assert auth.authenticate(b"  BEARER   " + KEY_A.encode() + b" ", None) == "team-a"


def test_x_api_key_identifies_tenant(auth: Authenticator) -> None:
    assert auth.authenticate(None, KEY_B.encode()) == "team-b"


def test_bearer_wins_over_x_api_key(auth: Authenticator) -> None:
    assert auth.authenticate(b"Bearer " + KEY_A.encode(), KEY_B.encode()) == "team-a"


def test_non_bearer_authorization_falls_back_to_x_api_key(auth: Authenticator) -> None:
    assert auth.authenticate(b"Basic dXNlcjpwYXNz", KEY_B.encode()) == "team-b"
    assert auth.authenticate(b"Basic dXNlcjpwYXNz", None) is None


@pytest.mark.parametrize(
    ("authorization", "x_api_key"),
    [
        (None, None),
        (b"", b""),
        (b"Bearer", None),
        (b"Bearer ", None),
        (b"Bearer sk-unknown", None),
        (None, b"sk-unknown"),
        (KEY_A.encode(), None),  # no scheme
        (b"Bearer " + hash_api_key(KEY_A).encode(), None),  # the digest is not the key
    ],
)
def test_missing_or_unknown_key_is_rejected(
    auth: Authenticator, authorization: bytes | None, x_api_key: bytes | None
) -> None:
    assert auth.authenticate(authorization, x_api_key) is None


def test_plaintext_key_in_config_is_refused_without_echoing_it() -> None:
    with pytest.raises(ValueError) as excinfo:
        Authenticator([("team-a", KEY_A)])
    assert KEY_A not in str(excinfo.value)
    with pytest.raises(ValueError):
        Authenticator([("team-a", "sha256:" + "A" * 64)])  # uppercase hex is not the canonical form


def test_one_key_for_two_tenants_is_refused() -> None:
    with pytest.raises(ValueError, match="team-a"):
        Authenticator([("team-a", hash_api_key(KEY_A)), ("team-b", hash_api_key(KEY_A))])


def test_several_keys_may_share_a_tenant() -> None:
    auth = Authenticator([("team-a", hash_api_key(KEY_A)), ("team-a", hash_api_key(KEY_B))])
    assert auth.authenticate(None, KEY_B.encode()) == "team-a"
    assert len(auth) == 2


def test_authenticate_takes_microseconds(auth: Authenticator) -> None:
    header = b"Bearer " + KEY_A.encode()
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        auth.authenticate(header, None)
    per_call_us = (time.perf_counter() - start) / n * 1e6
    assert per_call_us < 50, per_call_us  # ~1-2 µs on a laptop; generous for slow CI
