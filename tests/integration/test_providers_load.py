"""`providers verify --load`: three mocks behind a child gateway; one provider forced down half way (and a
mock killed mid-run besides): the client sees no failure, the share moves, the plot is written."""

from __future__ import annotations

import json
import threading
import time

from gateway.cli import main
from loadtest.mock_provider import MockProviderHandle
from tests.harness import candidate, envelope, mock_served


def _stop_once_forced_down(forced: MockProviderHandle, alive: MockProviderHandle, victim: MockProviderHandle,
                           done: threading.Event) -> None:
    """Stop ``victim`` once the second phase has begun: ``forced`` served the load (more requests than the
    checks before it send) and then nothing for 0.3 s while ``alive`` kept serving. A fixed delay from the
    start was racy: on a busy machine the checks and the child's start took long enough for the kill to land
    in the first phase, whose shares then missed too."""
    seen = mock_served(forced)
    armed = False
    last = (seen, mock_served(alive), time.monotonic())
    while not done.wait(0.05):
        now = (mock_served(forced), mock_served(alive), time.monotonic())
        if now[0] != last[0]:
            armed = armed or now[0] - seen >= 30
            last = now
        elif armed and now[2] - last[2] >= 0.3 and now[1] - last[1] > 10:
            victim.stop()
            return


def test_load_share_moves_when_a_provider_goes_down(mock_provider, tmp_path, capsys) -> None:
    mocks = {name: mock_provider(name, models="m") for name in ("a", "b", "c")}
    (tmp_path / "overlay.json").write_text(json.dumps(envelope([candidate("m", n) for n in mocks], "roundRobin")))
    config = {"clusters": [{"name": n, "endpoints": [h.address]} for n, h in mocks.items()],
              "routing": {"overlay_file": "overlay.json", "retry": {"attempts": 3}}}
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(config))
    done = threading.Event()  # b really dies, early in the second phase
    killer = threading.Thread(target=_stop_once_forced_down, args=(mocks["c"], mocks["a"], mocks["b"], done))
    killer.start()
    try:
        code = main(["providers", "verify", "-c", str(path), "--load", "4s", "--report", str(tmp_path / "r"),
                     "--json"])
    finally:
        done.set()
        killer.join()
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
