"""`providers verify --load`: three mocks behind a child gateway; one provider forced down half way (and a
mock killed mid-run besides): the client sees no failure, the share moves, the plot is written."""

from __future__ import annotations

import json
import threading

from gateway.cli import main
from tests.harness import candidate, envelope


def test_load_share_moves_when_a_provider_goes_down(mock_provider, tmp_path, capsys) -> None:
    mocks = {name: mock_provider(name, models="m") for name in ("a", "b", "c")}
    (tmp_path / "overlay.json").write_text(json.dumps(envelope([candidate("m", n) for n in mocks], "roundRobin")))
    config = {"clusters": [{"name": n, "endpoints": [h.address]} for n, h in mocks.items()],
              "routing": {"overlay_file": "overlay.json", "retry": {"attempts": 3}}}
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(config))
    killer = threading.Timer(3.0, mocks["b"].stop)  # a provider that really dies, late in the second phase
    killer.start()
    try:
        code = main(["providers", "verify", "-c", str(path), "--load", "4s", "--report", str(tmp_path / "r"),
                     "--json"])
    finally:
        killer.cancel()
    document = json.loads(capsys.readouterr().out)
    first, second = document["load"]
    # b's death is not the announced change: phase two's shares miss the promise, and the exit says so
    assert first["share_verdict"] == "pass" and second["share_verdict"] == "fail", (first, second)
    assert any(miss.startswith("b ") for miss in second["share_misses"])
    assert code == 3 and document["conformant"]  # every check passed; the load's shares did not
    assert first["error_rate"] == 0 and second["error_rate"] == 0  # failover hides both deaths
    assert set(first["share"]) == {"a", "b", "c"} and all(0.2 < s < 0.45 for s in first["share"].values())
    assert second["share"].get("c", 0) < 0.05  # forced down half way (an old worker may drain a last few)
    assert second["share"]["a"] > 0.5  # b died too: a carries the rest
    assert first["latency_ms"]["p50"] is not None
    assert (tmp_path / "r" / "load.png").stat().st_size > 1000
