"""`gridgate keys ...`: what the CLI sends and how it shows answers (gateway.keys.admin_client)."""

from __future__ import annotations

import pytest

from gateway.cli import build_parser, main
from gateway.keys.admin_client import connect_address, create_body, expires_at, record_lines, table, with_key


def test_create_flags_become_the_api_body():
    body = create_body("team-a", "ci", ["gpt-*", "o1*"], 60, "30d", ["owner=bob", "env=a=b"], now=1_800_000_000)
    assert body == {"tenant": "team-a", "alias": "ci", "models": ["gpt-*", "o1*"],
                    "limits": {"requests": [{"window": "1m", "count": 60}]},
                    "expires_at": "2027-02-14T08:00:00Z", "metadata": {"owner": "bob", "env": "a=b"}}
    assert create_body("t", None, None, None, None, []) == {"tenant": "t"}
    assert expires_at("2030-01-01T00:00:00Z", 0) == "2030-01-01T00:00:00Z"  # a time passes as written


def test_wildcard_listen_addresses_are_reached_on_this_host():
    assert connect_address("0.0.0.0:9901") == ("127.0.0.1", 9901)
    assert connect_address("[::]:9901") == ("::1", 9901)
    assert connect_address("10.1.2.3:9901") == ("10.1.2.3", 9901)


def test_answers_are_shown_as_tables_and_field_lines():
    rows = [{"kid": "AbCdEfGhIjKl", "tenant": "team-a", "alias": None, "status": "active", "expires_at": None,
             "last_used_at": "2026-12-01T10:00:00Z"}]
    lines = table(rows).splitlines()
    assert lines[0].split() == ["KID", "TENANT", "ALIAS", "STATUS", "EXPIRES", "LAST", "USED"]
    assert lines[1].split() == ["AbCdEfGhIjKl", "team-a", "-", "active", "-", "2026-12-01T10:00:00Z"]
    shown = with_key({"key": "gg-AbCdEfGhIjKl-x", "record": {"kid": "AbCdEfGhIjKl", "models": ["a*"]}})
    assert shown.splitlines()[0] == "key: gg-AbCdEfGhIjKl-x" and "shown this once" in shown
    assert record_lines({"kid": "k", "metadata": {"a": "b"}}) == 'kid:      k\nmetadata: {"a":"b"}'


def test_usage_errors_exit_2_and_bad_metadata_exits_1(capsys):
    with pytest.raises(SystemExit) as usage:
        build_parser().parse_args(["keys", "create"])  # --tenant is required
    assert usage.value.code == 2
    capsys.readouterr()
    assert main(["keys", "create", "--tenant", "t", "--metadata", "novalue", "--admin", "127.0.0.1:1"]) == 1
    assert capsys.readouterr().err.strip() == "--metadata: give KEY=VALUE"
