"""The demo topology behind `make run`: three mock providers and the gateway, in the foreground.

    .venv/bin/python -m loadtest.demo [--config deploy/demo/gridgate.yaml] [--workers N]

Providers provider-a/b/c listen on 127.0.0.1:9001-9003 with a little latency and a visible token
rate; then `python -m gateway run -c deploy/demo/gridgate.yaml` runs until Ctrl-C or SIGTERM. The
signal is forwarded to the gateway once, the gateway drains and exits, then the providers stop.
The terminal shows the gateway's own log (standard error). The access log, which the config sends
to standard output (as under systemd, where it reaches the journal), goes to ``DEMO_ACCESS_LOG``
instead of flooding the terminal; the banner says where.

The children run in their own sessions so a terminal's Ctrl-C reaches only this script: the
gateway then gets exactly one SIGINT (from here) and the providers outlive it until it has drained.
They also get SIGTERM if this script dies (PR_SET_PDEATHSIG), so nothing is left behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from types import FrameType

from loadtest.make_overlay import ensure_stamped
from loadtest.mock_provider import MockProviderHandle, child_setup, start_mock_provider_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_CONFIG = os.path.join(ROOT, "deploy", "demo", "gridgate.yaml")
DEMO_OVERLAY = os.path.join(ROOT, "deploy", "demo", "overlay.json")
DEMO_ACCESS_LOG = os.path.join(ROOT, "deploy", "demo", "access.log")  # the gateway's standard output
ADMIN = ("127.0.0.1", 9901)
PROVIDERS = (("provider-a", 9001), ("provider-b", 9002), ("provider-c", 9003))
# Enough delay to watch tokens arrive one by one, little enough to feel responsive.
PROVIDER_OPTIONS = {"latency_ms": 20, "ttft_ms": 150, "tokens_per_s": 25, "tokens": 24,
                    "models": "demo-model,demo-small"}
READY_TIMEOUT_S = 30.0

BANNER = """
gridgate demo is up: data plane http://127.0.0.1:8080, admin http://127.0.0.1:9901 (API key: sk-demo)
  curl -s localhost:8080/v1/models -H 'Authorization: Bearer sk-demo'
  curl -si localhost:8080/v1/chat/completions -H 'Authorization: Bearer sk-demo' -H 'Content-Type: application/json' -d '{"model":"demo-model","messages":[{"role":"user","content":"hi"}]}'
  curl -sN localhost:8080/v1/chat/completions -H 'Authorization: Bearer sk-demo' -H 'Content-Type: application/json' -d '{"model":"demo-model","stream":true,"messages":[{"role":"user","content":"hi"}]}'
  curl -s localhost:9901/admin/overlay      curl -s localhost:9001/metrics
  curl -s -XPOST localhost:9001/admin/health -H 'Content-Type: application/json' -d '{"status":503}'   # fail provider-a's health check
{access_log}
Ctrl-C stops everything.
"""


def banner(config_path: str) -> str:
    return BANNER.replace("{access_log}", access_log_note(config_path))


def access_log_note(config_path: str) -> str:
    """Where the gateway run with ``config_path`` (its standard output in ``DEMO_ACCESS_LOG``) writes its
    access log, for the banner."""
    from gateway.config import ConfigError, load_config

    try:
        settings = (config := load_config(config_path)).access_log
    except ConfigError:
        return "access log: see the config (it did not load here)"
    if not settings.enabled:
        return "access log: off"
    path = os.path.relpath(DEMO_ACCESS_LOG if settings.path == "-" else config.file_path(settings.path))
    return f"access log (one JSON line per request): {path}    tail -f {path}"


def admin_ready(timeout: float = 0.5) -> bool:
    """True when the admin listener answers GET /readyz with 200."""
    try:
        with socket.create_connection(ADMIN, timeout=timeout) as sock:
            sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return sock.recv(16).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def start_providers() -> list[MockProviderHandle]:
    providers: list[MockProviderHandle] = []
    try:
        for name, port in PROVIDERS:
            providers.append(start_mock_provider_process(port, name, new_session=True, **PROVIDER_OPTIONS))
    except BaseException:  # Ctrl-C while starting included
        stop_providers(providers)
        raise
    return providers


def stop_providers(providers: list[MockProviderHandle]) -> None:
    for provider in providers:
        provider.stop()


class SignalForwarder:
    """Forwards SIGINT/SIGTERM to the gateway; it decides how to drain (a second signal is passed on too)."""

    def __init__(self, gateway: subprocess.Popen[bytes]) -> None:
        self.gateway = gateway
        self.received = 0
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.forward)

    def forward(self, signum: int, _frame: FrameType | None) -> None:
        self.received += 1
        if self.received == 1:
            print("\ndemo: stopping (gateway drains in-flight requests)...", file=sys.stderr, flush=True)
        if self.gateway.poll() is None:
            self.gateway.send_signal(signum)


def wait_until_ready(gateway: subprocess.Popen[bytes], forwarder: SignalForwarder) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and gateway.poll() is None and not forwarder.received:
        if admin_ready():
            return True
        time.sleep(0.2)
    return False


def run(config: str, workers: int | None) -> int:
    if os.path.abspath(config) == DEMO_CONFIG and ensure_stamped(DEMO_OVERLAY):
        print(f"demo: re-stamped the digest of {DEMO_OVERLAY}", file=sys.stderr)
    try:
        providers = start_providers()
    except RuntimeError as exc:
        print(f"demo: cannot start the mock providers: {exc} (is something on ports 9001-9003?)",
              file=sys.stderr)
        return 1
    print("demo: mock providers " + ", ".join(f"{p.name}@{p.address}" for p in providers), file=sys.stderr)
    cmd = [sys.executable, "-m", "gateway", "run", "-c", config]
    if workers is not None:
        cmd += ["--workers", str(workers)]
    access_log = open(DEMO_ACCESS_LOG, "ab")  # noqa: SIM115 - the gateway's stdout for its whole life
    try:
        gateway = subprocess.Popen(cmd, cwd=ROOT, stdout=access_log, start_new_session=True,
                                   preexec_fn=child_setup(None))
        forwarder = SignalForwarder(gateway)
        if wait_until_ready(gateway, forwarder):
            print(banner(config), file=sys.stderr, flush=True)
        elif gateway.poll() is None and not forwarder.received:
            print(f"demo: gateway not ready after {READY_TIMEOUT_S:.0f}s; still waiting on it", file=sys.stderr)
        code = gateway.wait()
    finally:
        access_log.close()
        stop_providers(providers)
    # A gateway ended by our forwarded signal exits 0 when it drains cleanly; pass its verdict on.
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--config", "-c", default=DEMO_CONFIG)
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args(argv)
    return run(args.config, args.workers)


if __name__ == "__main__":
    sys.exit(main())
