"""The docs a clone ships stand on their own: no reference leaves the repository, links resolve,
and every metric the code exports is documented."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", REPO / "deploy" / "README.md", *(REPO / "docs").rglob("*.md")])

_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")
_OUTSIDE = re.compile(r"\.\./shared|CONTRACT(\.md| §)")


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def _links(page: Path) -> list[str]:
    return [m.group("target") for m in _LINK.finditer(page.read_text())]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_reference_leaves_the_repository(page):
    found = sorted({m.group(0) for m in _OUTSIDE.finditer(page.read_text())})
    assert not found, f"{_name(page)} refers to documents a clone does not have: {found}"


def test_the_pages_have_links_to_check():
    relative = [target for page in PAGES for target in _links(page) if not re.match(r"[a-z]+:", target)]
    assert len(relative) >= 20, "the link search no longer finds the pages' links"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve_inside_the_repository(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if REPO not in path.parents and path != REPO:
            broken.append(f"{target} (outside the repository)")
        elif not path.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{_name(page)}: {broken}"


def test_every_exported_metric_is_documented():
    sources = [*(REPO / "gateway").rglob("*.py"), *(REPO / "workers").rglob("*.py")]
    names = {m for path in sources for m in re.findall(r'"(gridgate_[a-z_]+)"', path.read_text())}
    assert len(names) > 10  # the search itself still finds the families
    documented = (REPO / "docs" / "operations.md").read_text()
    missing = sorted(name for name in names if f"`{name}" not in documented)
    assert not missing, f"add these metrics to docs/operations.md: {missing}"
