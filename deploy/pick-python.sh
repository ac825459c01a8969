#!/bin/sh
# Print the Python interpreter `make install` builds the virtualenv with (docs/operations.md, "The
# interpreter"). Among python3.11, python3.12 and python3.13 (in that order, on PATH and in /usr/bin), the
# first that can make a virtualenv and does not run from a shared libpython: a distribution's python3 is
# such a build, optimized with PGO and LTO, and spends about 13 % less CPU per request than the
# shared-library builds pyenv and most builds from source make. Else `python3`. `make PY=...` overrides.
# Arguments, when given, replace that list of candidates (the tests' way in). The build is judged by the
# supervisor's own reading of it (gateway/interpreter.py, which needs nothing outside the standard library).
root=$(cd "$(dirname "$0")/.." && pwd)
[ $# -gt 0 ] || set -- python3.11 /usr/bin/python3.11 python3.12 /usr/bin/python3.12 python3.13 /usr/bin/python3.13
for candidate in "$@"; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" - "$root" >/dev/null 2>&1 <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
import ensurepip, venv  # noqa: E402,F401  (Debian's python3 needs python3-venv for ensurepip)
from gateway.interpreter import interpreter_build  # noqa: E402
sys.exit(0 if interpreter_build().shared_libpython is False else 1)
EOF
    then
        command -v "$candidate"
        exit 0
    fi
done
echo python3
