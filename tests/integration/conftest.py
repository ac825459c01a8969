"""Integration fixtures: a real Valkey from the bundled binary, one per test session; every test started clear
of the end of an hour."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import valkey

from gateway.valkey.embedded import EmbeddedValkey
from tests.harness import clear_of_window_end


@pytest.fixture(scope="session")
def valkey_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of an embedded Valkey shared by the session (tests isolate themselves by tenant name)."""
    server = EmbeddedValkey(tmp_path_factory.mktemp("valkey"))
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


@pytest.fixture
def keys_store(tmp_path) -> Iterator[EmbeddedValkey]:
    """A Valkey of this test's own, on TCP (a fixed URL across restarts): the
    managed-key tests' store, and their gateways' quota backend."""
    server = EmbeddedValkey(tmp_path / "store", unix_socket=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def store(valkey_url: str) -> Iterator[valkey.Valkey]:
    """A plain client of the session's Valkey, for tests that read or publish keys directly."""
    client = valkey.Valkey.from_url(valkey_url)
    yield client
    client.close()


@pytest.fixture(autouse=True)
def clear_of_the_hour() -> None:
    """Each test starts at least 30 s before the end of a UTC hour (waiting the end out when it is closer).
    Hourly token budgets and UTC days (rollups, "1d" budgets and spend periods) end on the hour, and a test
    that fills one of those windows, or reads back what it holds, across its end finds a new, empty one.
    The tests here take seconds; waiting costs at most 30 s, once in a run that crosses an hour."""
    clear_of_window_end(3600, 30)
