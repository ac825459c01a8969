"""No module of the gateway, the workers or the shared-memory layer grows past 500 lines: one concern per
module (split along a real seam when one outgrows it)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 500


def test_no_module_in_gateway_workers_or_shm_is_over_500_lines():
    modules = [path for package in ("gateway", "workers", "shm") for path in (REPO / package).rglob("*.py")]
    assert len(modules) > 100  # the search still finds the code
    over = {str(path.relative_to(REPO)): lines for path in modules
            if (lines := len(path.read_text().splitlines())) > MAX_LINES}
    assert not over, f"split these modules along a seam (lines): {over}"
