"""docs/architecture.md maps the code: its module map names every product module once and nothing that does
not exist, and its layer drawing lists the layers of the import contract in pyproject.toml.

The conventions this test holds the page to (the page states them too, under "Keeping this page current"):

- Product modules are the ``.py`` files under ``gateway/``, ``workers/``, ``shm/`` and ``loadtest/`` (the
  packages the wheel ships, ``[tool.setuptools.packages.find]``).
- The module map is the section ``## Every module`` (up to the next ``## `` heading). Each module is one list
  item that starts with its path in backticks, a colon and what it does, on that line:
  ``- `gateway/quota/ledger.py`: the shared ledger in Valkey``. Every list item of the section is one.
- Packages: a directory holding an ``__init__.py`` is named by the directory with a trailing slash
  (``- `gateway/quota/`: ...``); that item stands for its ``__init__.py``, which is never named as a file.
  Every other ``.py`` file is named by its own path (``loadtest/opcount_site/`` holds no ``__init__.py``, so
  its ``sitecustomize.py`` is named as a file).
- Anywhere on the page, a path under those four directories, in backticks or as a relative link, exists.
- The layer drawing is the first code block of the section ``## The layers``. A layer is a run of lines that
  name modules (dotted names starting ``gateway``, ``workers``, ``shm`` or ``loadtest``); runs are separated
  by a line that names none. Top layer first, the names of each layer in the contract's order: exactly the
  ``layers`` of the ``type = "layers"`` contract in ``[tool.importlinter]``.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"
ROOTS = ("gateway", "workers", "shm", "loadtest")

_ROOT = "(?:" + "|".join(ROOTS) + ")"
_ITEM = re.compile(rf"^- `(?P<path>{_ROOT}/[\w/.-]*)`: (?P<text>\S.*)$")
_BACKTICK_PATH = re.compile(rf"`(?P<path>{_ROOT}/[\w/.-]*)`")
_LINK_PATH = re.compile(rf"\]\((?:\.\./)+(?P<path>{_ROOT}/[^)#\s]*)")
_DOTTED = re.compile(rf"(?<![\w.]){_ROOT}(?:\.\w+)*(?![\w.])")


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section, up to the next second-level heading."""
    lines = text.splitlines()
    assert f"## {heading}" in lines, f"docs/architecture.md has no section '## {heading}'"
    start = lines.index(f"## {heading}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def product_modules() -> set[str]:
    """What the module map must name: package directories (``gateway/quota/``) and the other ``.py`` files."""
    names = set()
    for root in ROOTS:
        for path in (REPO / root).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            relative = path.relative_to(REPO)
            names.add(f"{relative.parent}/" if path.name == "__init__.py" else str(relative))
    return names


def map_items() -> list[tuple[str, str]]:
    """The module map's items, ``(path, description)``; fails on a list item that breaks the convention."""
    items, malformed = [], []
    for line in _section(ARCHITECTURE.read_text(), "Every module").splitlines():
        if not line.startswith(("- ", "* ", "+ ")):
            continue
        match = _ITEM.match(line)
        if match is None:
            malformed.append(line)
        else:
            items.append((match.group("path"), match.group("text")))
    assert not malformed, ("module map items are written - `path`: what it does (a package as `dir/`): "
                           f"{malformed}")
    return items


def test_the_product_search_finds_the_code():
    modules = product_modules()
    assert len(modules) > 200
    assert {"gateway/", "gateway/quota/", "gateway/quota/ledger.py", "workers/proxy.py", "shm/segment.py"} <= modules


def test_the_module_map_names_every_product_module():
    named = {path for path, _ in map_items()}
    missing = sorted(product_modules() - named)
    assert not missing, f"add a line for each to docs/architecture.md, '## Every module': {missing}"


def test_the_module_map_names_only_modules_that_exist_each_once():
    paths = [path for path, _ in map_items()]
    init_files = sorted(p for p in paths if p.endswith("__init__.py"))
    assert not init_files, f"name a package by its directory (gateway/quota/), not its __init__.py: {init_files}"
    unknown = sorted(set(paths) - product_modules())
    assert not unknown, f"docs/architecture.md's module map names what is not a module or package: {unknown}"
    twice = sorted({p for p in paths if paths.count(p) > 1})
    assert not twice, f"docs/architecture.md's module map names these more than once: {twice}"


def test_every_code_path_the_page_names_exists():
    text = ARCHITECTURE.read_text()
    paths = {m.group("path") for m in _BACKTICK_PATH.finditer(text)} | {m.group("path") for m in _LINK_PATH.finditer(text)}
    assert len(paths) > 200  # the searches still find the page's paths
    gone = sorted(p for p in paths if not (REPO / p).exists())
    assert not gone, f"docs/architecture.md names paths that do not exist: {gone}"


def contract_layers() -> list[list[str]]:
    """The layers of the import-linter ``layers`` contract, top first, each its names in order."""
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = [c for c in settings["contracts"] if c["type"] == "layers"]
    assert len(contracts) == 1, "expected one layers contract in [tool.importlinter]"
    return [[name.strip() for name in re.split(r"[:|]", layer)] for layer in contracts[0]["layers"]]


def drawn_layers() -> list[list[str]]:
    """The layers of the page's drawing: runs of lines naming modules, top first."""
    section = _section(ARCHITECTURE.read_text(), "The layers")
    block = re.search(r"^```[^\n]*\n(?P<body>.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert block is not None, "docs/architecture.md, '## The layers': no code block with the drawing"
    layers: list[list[str]] = []
    run: list[str] = []
    for line in block.group("body").splitlines():
        names = _DOTTED.findall(line)
        if names:
            run.extend(names)
        elif run:
            layers.append(run)
            run = []
    if run:
        layers.append(run)
    return layers


def test_the_layer_drawing_is_the_import_contract():
    contract = contract_layers()
    assert len(contract) >= 5 and contract[0] == ["loadtest"]  # the parse still finds the contract
    drawn = drawn_layers()
    assert drawn == contract, (
        "the drawing in docs/architecture.md, '## The layers', must list the layers of pyproject.toml's "
        f"[tool.importlinter] layers contract, top first:\n drawn:    {drawn}\n contract: {contract}")


def test_every_layer_name_is_a_real_module_or_package():
    missing = []
    for name in (n for layer in contract_layers() for n in layer):
        path = REPO / name.replace(".", "/")
        if not (path.with_suffix(".py").exists() or (path / "__init__.py").exists()):
            missing.append(name)
    assert not missing, f"pyproject.toml's layers name modules that do not exist: {missing}"
