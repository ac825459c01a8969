"""Shared fixtures: real mock providers and real gateway processes on loopback."""

from __future__ import annotations

import compileall
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from loadtest.mock_provider import MockProviderHandle, start_mock_provider_process
from tests.harness import ROOT, Gateway
from tests.inprocess import LoopbackGateway
from tests.schedule import load_durations, longest_files_first


def pytest_configure(config: pytest.Config) -> None:
    """Byte-compile the product once, in the main process, before any test starts: the suite starts
    hundreds of Python processes (gateways, their workers, mock providers, the CLI), and where
    PYTHONDONTWRITEBYTECODE is set (as on this team's machines) each of them would otherwise compile every
    module it imports from source again: a two-worker gateway took 2.2 s to be ready instead of 0.65 s
    (medians of 8 alternated starts). Files already compiled and unchanged are only looked at."""
    if hasattr(config, "workerinput"):  # an xdist worker: the main process did it
        return
    for package in ("gateway", "workers", "shm", "loadtest", "tests"):
        compileall.compile_dir(os.path.join(ROOT, package), quiet=1, workers=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest test files first (tests/schedule.py): with the Makefile's ``--dist loadfile
    --no-loadscope-reorder`` no long file is handed out last to make the run's tail alone."""
    items[:] = longest_files_first(items, load_durations())


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


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Stop the test's gateways before any fixture is torn down. Fixtures end in the reverse order of their
    setup, so a Valkey (or a fake server) the test asked for after ``gateway_factory`` would stop first, and
    each gateway would then spend seconds of its shutdown retrying settlements against a dead store."""
    for gateway in getattr(item, "gateways", ()):
        gateway.stop()
    return (yield)


@pytest.fixture
def gateway_factory(request: pytest.FixtureRequest, tmp_path) -> Iterator[Callable[..., Gateway]]:
    gateways: list[Gateway] = []
    request.node.gateways = gateways  # stopped first at teardown (pytest_runtest_teardown above)

    def create(clusters: dict[str, list[str]], overlay: dict[str, Any], start: bool = True, **kwargs: Any) -> Gateway:
        directory = tmp_path / f"gw{len(gateways)}"
        directory.mkdir()
        gateway = Gateway(str(directory), clusters, overlay, **kwargs)
        gateways.append(gateway)
        return gateway.start() if start else gateway

    yield create
    for gateway in gateways:
        gateway.stop()


@pytest.fixture
def loopback_gateway_factory(request: pytest.FixtureRequest, tmp_path) -> Iterator[Callable[..., LoopbackGateway]]:
    """``gateway_factory`` for one request's behaviour: the same worker in a thread of this process, on a
    real loopback socket (tests/inprocess.py ``LoopbackGateway``: no fork, no supervisor, one worker)."""
    gateways: list[LoopbackGateway] = []
    request.node.gateways = gateways

    def create(clusters: dict[str, list[str]], overlay: dict[str, Any], **kwargs: Any) -> LoopbackGateway:
        directory = tmp_path / f"lgw{len(gateways)}"
        directory.mkdir()
        gateway = LoopbackGateway(str(directory), clusters, overlay, **kwargs)
        gateways.append(gateway)
        return gateway.start()

    yield create
    for gateway in gateways:
        gateway.stop()
