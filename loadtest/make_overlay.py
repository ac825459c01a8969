"""Stamp the semantic revision into Grid envelope-v1 overlay files (docs/overlay.md#semantic-revision-digest).

    python -m loadtest.make_overlay deploy/demo/overlay.json [more.json ...]   # rewrite if stale
    python -m loadtest.make_overlay --check deploy/demo/overlay.json           # exit 1 if stale

The digest is SHA-256 over the RFC 8785 canonical JSON of `{candidates, local_site, network,
selection_policy (when present)}` taken from the overlay document. The digest itself comes from
`gateway.overlay.digest`, the same code the gateway validates with.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from gateway.overlay.digest import semantic_revision


def overlay_document(data: dict[str, Any]) -> dict[str, Any]:
    """The overlay document: `overlay` of an envelope, or the whole legacy document."""
    inner = data.get("overlay")
    return inner if isinstance(inner, dict) else data


def stamp(envelope: dict[str, Any]) -> dict[str, Any]:
    """Set `revision` and `content_digest` of an envelope to the recomputed digest (in place)."""
    digest = semantic_revision(overlay_document(envelope))
    envelope["revision"] = {"kind": "content_addressed", "algorithm": "sha256", "value": digest}
    envelope["content_digest"] = {"algorithm": "sha256", "value": digest}
    return envelope


def is_stamped(envelope: dict[str, Any]) -> bool:
    digest = semantic_revision(overlay_document(envelope))
    revision, content = envelope.get("revision"), envelope.get("content_digest")
    return (isinstance(revision, dict) and revision.get("value") == digest
            and isinstance(content, dict) and content.get("value") == digest)


def write_json_atomically(path: str, data: Any) -> None:
    """Write temp, fsync, rename: a watching gateway never reads a half-written overlay."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".overlay-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(data, out, indent=2)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def ensure_stamped(path: str) -> bool:
    """Rewrite the overlay file if its digest is stale; True when it was rewritten."""
    with open(path) as src:
        envelope = json.load(src)
    if is_stamped(envelope):
        return False
    write_json_atomically(path, stamp(envelope))
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.make_overlay", description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", help="envelope-v1 overlay files")
    parser.add_argument("--check", action="store_true", help="only report stale files (exit 1 if any)")
    args = parser.parse_args(argv)
    stale = 0
    for path in args.files:
        with open(path) as src:
            envelope = json.load(src)
        digest = semantic_revision(overlay_document(envelope))
        if args.check:
            ok = is_stamped(envelope)
            stale += not ok
            print(f"{path}: {'ok' if ok else 'stale'} {digest}")
        else:
            changed = ensure_stamped(path)
            print(f"{path}: {'stamped' if changed else 'unchanged'} {digest}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
