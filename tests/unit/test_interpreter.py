"""The interpreter build: the supervisor's start-up warning and the choice `make install` makes
(deploy/pick-python.sh, docs/operations.md "The interpreter")."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.interpreter import InterpreterBuild, interpreter_build, shared_libpython, slow_build_warning

ROOT = Path(__file__).resolve().parents[2]
PICK = ROOT / "deploy" / "pick-python.sh"

SHARED_MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 1311 /root/.pyenv/versions/3.11.7/bin/python3.11
7f1c2a000000-7f1c2a0b2000 r--p 00000000 08:01 1402 /root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0
7f1c2a0b2000-7f1c2a2f0000 r-xp 000b2000 08:01 1402 /root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0
"""
STATIC_MAPS = """\
55d0c0a00000-55d0c0a9f000 r--p 00000000 08:01 1311 /usr/bin/python3.11
7f1c2a000000-7f1c2a022000 r--p 00000000 08:01 2201 /usr/lib/x86_64-linux-gnu/libc.so.6
7f1c2b000000-7f1c2b010000 r--p 00000000 08:01 2202 /opt/gridgate/.venv/lib/python3.11/site-packages/msgspec/_core.so
"""


def test_a_shared_libpython_is_seen_in_the_memory_map_and_a_static_interpreter_is_not() -> None:
    assert shared_libpython(SHARED_MAPS) is True
    assert shared_libpython(STATIC_MAPS) is False
    assert shared_libpython("") is False


def test_the_warning_names_the_interpreter_only_for_a_shared_libpython(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(SHARED_MAPS)
    build = interpreter_build(str(maps))
    assert build == InterpreterBuild(sys.executable, sys.version.split()[0], True)
    warning = slow_build_warning(build)
    assert warning is not None and sys.executable in warning and "The interpreter" in warning
    maps.write_text(STATIC_MAPS)
    assert slow_build_warning(interpreter_build(str(maps))) is None
    # No /proc (another OS): nothing known, nothing said.
    unknown = interpreter_build(str(tmp_path / "absent"))
    assert unknown.shared_libpython is None and slow_build_warning(unknown) is None


def _fake_python(directory: Path, name: str, exit_code: int) -> str:
    """An executable that reads the check from stdin and answers ``exit_code`` (0: fit)."""
    path = directory / name
    path.write_text(f"#!/bin/sh\ncat >/dev/null\nexit {exit_code}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _pick(*candidates: str) -> str:
    """The script's choice, run from elsewhere than the checkout (it finds the checkout itself)."""
    done = subprocess.run(["sh", str(PICK), *candidates], capture_output=True, text=True, timeout=60, check=True,
                          cwd="/")
    return done.stdout.strip()


def test_make_install_takes_the_first_fit_candidate_else_python3(tmp_path: Path) -> None:
    shared = _fake_python(tmp_path, "python-shared", 1)
    fit = _fake_python(tmp_path, "python-fit", 0)
    later_fit = _fake_python(tmp_path, "python-later", 0)
    assert _pick(str(tmp_path / "absent"), shared, fit, later_fit) == fit
    assert _pick(shared, str(tmp_path / "absent")) == "python3"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="no /proc on this system")
def test_the_scripts_check_agrees_with_the_supervisors_on_this_interpreter() -> None:
    """The real check, run by this test's own interpreter: fit exactly when the supervisor would not warn
    (a venv's python can always make a venv, so only the libpython decides)."""
    shared = interpreter_build().shared_libpython
    assert _pick(sys.executable) == (sys.executable if not shared else "python3")
    # The venv's base interpreter (the same binary, without the project installed): the script reads the
    # build with the checkout's own module all the same.
    base = sys._base_executable
    assert _pick(base) == (base if not shared else "python3")
