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


# -- docs/architecture.md: the map names real files, functions and tests ---------------------------------

ARCHITECTURE = REPO / "docs" / "architecture.md"
_CODE_LINK = re.compile(r"\]\((?P<target>[^)\s#]+\.py)\) `(?P<symbol>[A-Za-z_][\w.]*)`")
_REPO_PATH = re.compile(r"`(?P<path>(?:gateway|workers|shm|tests|loadtest|deploy)/[\w/.-]+)`")
_TEST_IN = re.compile(r"`(?P<test>test_\w+)` in `(?P<path>tests/[\w/]+\.py)`")


def _defines(source: str, name: str, top_level: bool) -> bool:
    indent = "" if top_level else r"[ \t]+"
    pattern = rf"^{indent}(?:async def|def|class) {name}\b|^{indent}{name}\s*(?::[^=\n]*)?="
    return re.search(pattern, source, re.MULTILINE) is not None


def test_the_architecture_map_names_functions_its_files_define():
    text = ARCHITECTURE.read_text()
    pairs = [(m.group("target"), m.group("symbol")) for m in _CODE_LINK.finditer(text)]
    assert len(pairs) >= 30, "the search no longer finds the map's `file` `symbol` pairs"
    missing = []
    for target, symbol in pairs:
        source = (ARCHITECTURE.parent / target).resolve().read_text()
        first, *rest = symbol.split(".")
        if not _defines(source, first, top_level=True) or not all(_defines(source, n, False) for n in rest):
            missing.append(f"{target} {symbol}")
    assert not missing, f"docs/architecture.md names what these files do not define: {missing}"


def test_the_architecture_map_names_files_and_tests_that_exist():
    text = ARCHITECTURE.read_text()
    paths = {m.group("path") for m in _REPO_PATH.finditer(text)}
    assert len(paths) >= 10
    assert not sorted(p for p in paths if not (REPO / p).exists()), "docs/architecture.md names missing files"
    tests = [(m.group("test"), m.group("path")) for m in _TEST_IN.finditer(text)]
    assert tests, "the search no longer finds the map's tests to copy"
    gone = [f"{path}::{name}" for name, path in tests
            if not re.search(rf"^def {name}\(", (REPO / path).read_text(), re.MULTILINE)]
    assert not gone, f"docs/architecture.md names tests that do not exist: {gone}"


# -- code and tests cite the docs/ pages a clone has, never the contract outside it ------------------------

_NOT_THE_REPOSITORY = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "build"}
# Spelled in two parts so that this file does not cite what it forbids.
_CONTRACT_CITATION = re.compile("CONTRACT" + r"(?: ?§|\.md)")
_DOCS_CITATION = re.compile(r"\bdocs/(?P<page>[\w-]+\.md)(?:#(?P<anchor>[\w-]+))?")


def _repository_files() -> list[Path]:
    found = []
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if any(part in _NOT_THE_REPOSITORY or part.endswith(".egg-info") for part in parts):
            continue
        if path.is_file():
            found.append(path)
    return found


def test_nothing_in_the_repository_cites_the_contract_outside_it():
    files = _repository_files()
    assert len(files) > 300  # the walk still finds the repository
    cited = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # binary: nothing a reader would follow
            continue
        cited += [f"{_name(path)}:{text.count(chr(10), 0, m.start()) + 1}" for m in _CONTRACT_CITATION.finditer(text)]
    assert not cited, f"cite the docs/ page that explains it instead (see docs/README.md): {cited}"


def test_the_docs_pages_code_and_tests_cite_exist_with_their_sections():
    sources = [p for package in ("gateway", "workers", "shm", "tests", "loadtest") for p in (REPO / package).rglob("*.py")]
    citations = [(path, m) for path in sources for m in _DOCS_CITATION.finditer(path.read_text())]
    assert len(citations) > 50  # the search still finds the citations
    broken = []
    for path, match in citations:
        page = REPO / "docs" / match.group("page")
        if not page.exists():
            broken.append(f"{_name(path)}: docs/{match.group('page')} (no such page)")
        elif match.group("anchor") and match.group("anchor") not in _anchors(page):
            broken.append(f"{_name(path)}: {match.group(0)} (no such section)")
    assert not broken, f"citations of docs/ that do not resolve: {broken}"
