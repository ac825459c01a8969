"""What `make run` shows a newcomer: the demo config passes `gridgate check`, the access log does not
flood the terminal (the demo sends the gateway's standard output to a file) and the banner says where."""

from __future__ import annotations

import os

from gateway.check import check_problems
from gateway.config import load_config
from loadtest.demo import DEMO_ACCESS_LOG, DEMO_CONFIG, banner


def test_the_demo_config_checks_ok_and_logs_requests_to_standard_output() -> None:
    config = load_config(DEMO_CONFIG)
    assert check_problems(config, environ=None) == []
    assert config.access_log.enabled and config.access_log.path == "-"  # what the demo redirects to a file


def test_the_banner_says_where_the_access_log_is() -> None:
    text = banner(DEMO_CONFIG)
    path = os.path.relpath(DEMO_ACCESS_LOG)
    assert f"access log (one JSON line per request): {path}    tail -f {path}" in text
    assert "{access_log}" not in text
