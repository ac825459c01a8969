"""The speed scripts docs/identity.md quotes run and measure what they say: loadtest/bench_credential.py
(the head steps at several bearer lengths) and loadtest/jwt_verify_cost.py (a fresh, a cached and a kept
grant per algorithm)."""

from __future__ import annotations

from loadtest import bench_credential, jwt_verify_cost


def test_bench_credential_prints_every_step_at_every_length(capsys):
    assert bench_credential.main(["--number", "5", "--lengths", "40,700"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "µs" not in line]
    assert len(rows) == 11 and all(len(row.split("|")) == 5 for row in rows)
    assert any(row.startswith("| codec head parse, set-aside |") for row in rows)
    assert any(row.startswith("| codec head parse, plain-head parser |") for row in rows)


def test_jwt_verify_cost_measures_a_fresh_a_cached_and_a_kept_grant():
    for alg in ("ES256", "RS384"):
        length, fresh, cached, kept = jwt_verify_cost.measure(alg, 0.001)
        assert length > 300 and fresh > cached > 0 and kept > 0
