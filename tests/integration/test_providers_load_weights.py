"""`providers verify --load` against unequal weights: the promise is the picker's (a candidate listed twice is
two roundRobin slots; `picker: weighted` follows traffic_weight), the shares meet it in both phases, and the
phase split waits for the reload to take over instead of a fixed pause."""

from __future__ import annotations

import json

from gateway.cli import main
from tests.harness import candidate, envelope


def _run(tmp_path, capsys, mocks, candidates, routing) -> tuple[int, list[dict]]:
    (tmp_path / "overlay.json").write_text(json.dumps(envelope(candidates, "roundRobin")))
    config = {"clusters": [{"name": n, "endpoints": [h.address]} for n, h in mocks.items()],
              "routing": {"overlay_file": "overlay.json", "retry": {"attempts": 3}, **routing}}
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(config))
    code = main(["providers", "verify", "-c", str(path), "--load", "3s", "--json"])
    return code, json.loads(capsys.readouterr().out)["load"]


def test_round_robin_slots_are_weights(mock_provider, tmp_path, capsys) -> None:
    mocks = {name: mock_provider(name, models="m") for name in ("a", "b", "c")}
    a, b, c = (candidate("m", n) for n in mocks)
    code, (first, second) = _run(tmp_path, capsys, mocks, [a, a, b, c], {})
    assert first["picker"] == "roundRobin"
    assert first["promised"] == {"a": 0.5, "b": 0.25, "c": 0.25}
    assert second["promised"] == {"a": 2 / 3, "b": 1 / 3}
    assert first["share_verdict"] == "pass", first
    assert second["share_verdict"] == "pass", second
    assert abs(first["share"]["a"] - 0.5) < 0.05 and second["share"].get("c", 0) == 0
    assert second["note"].startswith("split ") and "served alone" in second["note"]
    assert code == 0


def test_weighted_picker_follows_traffic_weight(mock_provider, tmp_path, capsys) -> None:
    mocks = {name: mock_provider(name, models="m") for name in ("a", "b", "c")}
    weights = {"a": 6, "b": 3, "c": 1}
    models = [{"match": {"capability": "m", "cluster": n}, "traffic_weight": w} for n, w in weights.items()]
    code, (first, second) = _run(tmp_path, capsys, mocks, [candidate("m", n) for n in mocks],
                                 {"picker": "weighted", "models": models})
    assert first["picker"] == "weighted" and first["promised"] == {"a": 0.6, "b": 0.3, "c": 0.1}
    assert second["promised"] == {"a": 2 / 3, "b": 1 / 3}
    assert first["share_verdict"] == "pass" and second["share_verdict"] == "pass", (first, second)
    assert first["share"]["a"] > first["share"]["b"] > first["share"]["c"] > 0
    assert code == 0
