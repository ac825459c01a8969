"""What `make run` shows a newcomer: the demo config passes `gridgate check`, its access log goes to a
file (the terminal keeps the gateway's own log) and the banner says which."""

from __future__ import annotations

import os

from gateway.check import check_problems
from gateway.config import load_config
from loadtest.demo import DEMO_CONFIG, banner


def test_the_demo_config_checks_ok_and_logs_requests_to_a_file_next_to_it() -> None:
    config = load_config(DEMO_CONFIG)
    assert check_problems(config, environ=None) == []
    assert config.access_log.enabled and config.access_log.path != "-"
    assert os.path.dirname(config.file_path(config.access_log.path)) == os.path.dirname(DEMO_CONFIG)


def test_the_banner_says_where_the_access_log_is() -> None:
    text = banner(DEMO_CONFIG)
    assert f"access log (one JSON line per request): {os.path.relpath(os.path.join(os.path.dirname(DEMO_CONFIG), 'access.log'))}" in text
    assert "{access_log}" not in text
