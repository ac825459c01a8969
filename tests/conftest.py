"""Shared fixtures: real mock providers and real gateway processes on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process
from tests.harness import Gateway


@pytest.fixture(scope="session")
def providers() -> Iterator[dict[str, MockProviderHandle]]:
    """Three healthy mock providers (provider-a/b/c) shared by the whole session; do not break them."""
    handles = {name: start_mock_provider_process(0, name) for name in ("provider-a", "provider-b", "provider-c")}
    yield handles
    for handle in handles.values():
        handle.stop()


@pytest.fixture
def mock_provider() -> Iterator[Callable[..., MockProviderHandle]]:
    """A factory for private mock providers a test may break or slow down."""
    started: list[MockProviderHandle] = []

    def start(name: str = "mock", **opts: Any) -> MockProviderHandle:
        handle = start_mock_provider_process(0, name, **opts)
        started.append(handle)
        return handle

    yield start
    for handle in started:
        handle.stop()


@pytest.fixture
def gateway_factory(tmp_path) -> Iterator[Callable[..., Gateway]]:
    gateways: list[Gateway] = []

    def create(clusters: dict[str, list[str]], overlay: dict[str, Any], start: bool = True, **kwargs: Any) -> Gateway:
        directory = tmp_path / f"gw{len(gateways)}"
        directory.mkdir()
        gateway = Gateway(str(directory), clusters, overlay, **kwargs)
        gateways.append(gateway)
        return gateway.start() if start else gateway

    yield create
    for gateway in gateways:
        gateway.stop()
