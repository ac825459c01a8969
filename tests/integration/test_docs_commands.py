"""Every command the docs show runs as written, on a fresh checkout, so a doc that drifts fails here.

The shell blocks of README.md and docs/*.md are marked (see tests/docs_commands.py): `run` blocks
run in a copy of the repository's files (the virtualenv linked in), `run-in-sandbox` blocks with
`sudo` as a no-op and their install directories in a scratch directory, `skip` blocks are checked
statically only: the repository paths, `python -m` modules and `make` targets they name exist. A
page whose blocks need the demo gets `make run` started first, in a private network namespace when
the machine allows one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.docs_commands import Block, shell_blocks

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").rglob("*.md")),
         ROOT / "loadtest" / "README.md"]
BLOCKS = [block for page in PAGES for block in shell_blocks(ROOT, page)]
RUN_PAGES = sorted({block.page for block in BLOCKS if block.mode in ("run", "run-in-sandbox")})

_REPO_PATH = re.compile(r"(?<![\w/.$-])((?:deploy|docs|loadtest|tests|gateway|workers|shm)/[\w./-]*\w)")
_PYTHON_MODULE = re.compile(r"python -m ([\w.]+)")
_MAKE_TARGET = re.compile(r"(?:^|[\s;&|(])make ([\w-]+)")


def test_every_shell_block_is_marked() -> None:
    assert len(BLOCKS) >= 10  # the search still finds the blocks
    unmarked = [f"{block.where}: no <!-- docs-test: ... --> marker on the line before the block"
                for block in BLOCKS if block.mode is None]
    broken = [f"{block.where}: {block.problem}" for block in BLOCKS if block.problem]
    assert not unmarked + broken, "\n".join(unmarked + broken)


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.where)
def test_what_a_block_names_exists(block: Block) -> None:
    """Paths in the repository, `python -m` modules and `make` targets: checked for every block."""
    makefile = (ROOT / "Makefile").read_text()
    missing = [path for path in _REPO_PATH.findall(block.text)
               if not (ROOT / path).exists() and path not in GENERATED]
    missing += [f"python -m {module}" for module in _PYTHON_MODULE.findall(block.text) if find_spec(module) is None]
    missing += [f"make {target}" for target in _MAKE_TARGET.findall(block.text)
                if not re.search(rf"^{re.escape(target)}:", makefile, re.M)]
    assert not missing, f"{block.where} names what does not exist: {missing}"


# Files a block writes before it uses them.
GENERATED = {"deploy/control/overlay.json"}


# --------------------------------------------------------------------------- running them


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repository's files (tracked and new, as they are now) in a scratch directory, nothing else:
    no access log, cache or overlay a previous run left. The virtualenv is linked, not rebuilt."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    target = tmp_path_factory.mktemp("checkout")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)  # mtimes kept: make sees the install stamp as current
    (target / ".venv").symlink_to(ROOT / ".venv")
    up_to_date = subprocess.run(["make", "-q", "install"], cwd=target, capture_output=True)
    assert up_to_date.returncode == 0, "run `make install` first: the virtualenv is older than pyproject.toml"
    return target


def _namespace_prefix() -> list[str]:
    """`unshare` into a private network namespace (as root, or through a user namespace), if allowed."""
    for prefix in (["unshare", "--net"], ["unshare", "--map-root-user", "--net"]):
        if shutil.which("unshare") and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return []


def _sudo_shim(directory: Path) -> Path:
    shim = directory / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
    (shim / "sudo").chmod(0o755)
    return shim


@pytest.mark.parametrize("page", RUN_PAGES)
def test_the_commands_of_a_page_run_as_written(page: str, checkout: Path, tmp_path: Path) -> None:
    blocks = [block for block in BLOCKS if block.page == page and block.mode in ("run", "run-in-sandbox")]
    path = os.pathsep.join([str(checkout / ".venv" / "bin"), os.environ.get("PATH", "")])
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTEST"))}, "PATH": path}
    sandbox = {"PATH": os.pathsep.join([str(_sudo_shim(tmp_path)), path]), "OPT": str(checkout),
               "ETC": str(tmp_path / "etc" / "gridgate")}
    prefix = _namespace_prefix() if any(block.needs_demo for block in blocks) else []
    plan = {
        "checkout": str(checkout), "env": env, "isolated": bool(prefix),
        "blocks": [{"text": block.text, "needs_demo": block.needs_demo,
                    "env": sandbox if block.mode == "run-in-sandbox" else {}} for block in blocks],
    }
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    subprocess.run([*prefix, sys.executable, "-m", "tests.docs_commands", str(plan_path)], cwd=ROOT, check=True,
                   timeout=300)
    results = json.loads((tmp_path / "results.json").read_text())
    problems = [result["output"] for result in results if result["status"] is None]
    assert not problems, problems
    failures = []
    for block, result in zip(blocks, results, strict=True):
        status, output = result["status"], result["output"]
        if status != block.exit_status:
            failures.append(f"{block.where}: exit {status}, expected {block.exit_status}:\n{output[-2000:]}")
        failures += [f"{block.where}: output lacks {text!r}:\n{output[-2000:]}" for text in block.expect
                     if text not in output]
    assert not failures, "\n\n".join(failures)
