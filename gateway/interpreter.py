"""What kind of CPython build runs the gateway, for the operator (docs/operations.md, "The interpreter").

A distribution's python3 (Debian's, Ubuntu's, Fedora's) links the interpreter statically, optimized with
PGO and LTO. pyenv and most builds from source make a shared ``libpython`` without PGO: on the same
machine, the two side by side on one core, a worker on Debian's build served 15-16 % more requests than
on pyenv's, at 12-15 % less CPU per request (docs/operations.md). The supervisor logs a warning at start
when it runs from a shared libpython.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

SHARED_LIBPYTHON_WARNING = (
    "this Python ({executable}, {version}) runs from a shared libpython, as pyenv and most builds from "
    "source do, usually without PGO: the same gateway spends about 13 % less CPU per request on a "
    "distribution's python3 (docs/operations.md, 'The interpreter'; `make install` picks one when the "
    "machine has it)"
)


@dataclass(frozen=True, slots=True)
class InterpreterBuild:
    executable: str
    version: str
    shared_libpython: bool | None  # None: not known (no /proc)

    @property
    def kind(self) -> str:
        """The build in words, as reports print it."""
        return {True: "shared libpython", False: "static", None: "build unknown"}[self.shared_libpython]

    def as_dict(self) -> dict[str, str | bool | None]:
        return {"executable": self.executable, "version": self.version,
                "shared_libpython": self.shared_libpython}


def shared_libpython(maps_text: str) -> bool:
    """Whether a process's memory map (``/proc/<pid>/maps``) holds a shared libpython."""
    return any("/libpython3" in line for line in maps_text.splitlines())


def interpreter_build(maps_path: str = "/proc/self/maps") -> InterpreterBuild:
    try:
        with open(maps_path) as maps:
            shared: bool | None = shared_libpython(maps.read())
    except OSError:
        shared = None
    return InterpreterBuild(sys.executable, sys.version.split()[0], shared)


def slow_build_warning(build: InterpreterBuild) -> str | None:
    """The start-up warning for ``build``, None when there is nothing to say."""
    if build.shared_libpython:
        return SHARED_LIBPYTHON_WARNING.format(executable=build.executable, version=build.version)
    return None
