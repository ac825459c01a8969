"""Where the normative overlay-contract fixtures are (docs/overlay.md).

The source of truth is ``../shared/contract/overlay-v1`` beside the repository; a copy is vendored in
``tests/fixtures/overlay-v1`` so a clone without ``shared/`` still runs the suite.
"""

from __future__ import annotations

from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
_SHARED = _REPO.parent / "shared" / "contract" / "overlay-v1"
OVERLAY_FIXTURES = _SHARED if (_SHARED / "manifest.json").is_file() else _REPO / "tests" / "fixtures" / "overlay-v1"
