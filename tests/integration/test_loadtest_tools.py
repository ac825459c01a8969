"""Every tool under loadtest/ still starts: README and docs cite them (`python -m loadtest.bench_faults`),
and an import moved to another module must not leave one of them crashing at its first line."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULES = sorted(f"loadtest.{path.stem}" for path in (ROOT / "loadtest").glob("*.py") if path.stem != "__init__")
RUNNABLE = sorted(f"loadtest.{path.stem}" for path in (ROOT / "loadtest").glob("*.py")
                  if 'if __name__ == "__main__"' in path.read_text())


def test_every_loadtest_module_imports() -> None:
    # In a fresh interpreter: locustfile imports locust, which patches the standard library (gevent).
    script = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run([sys.executable, "-c", script, *MODULES], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(MODULES) >= 20


def test_every_runnable_loadtest_module_answers_help() -> None:
    assert {"loadtest.bench_faults", "loadtest.demo", "loadtest.mock_provider"} <= set(RUNNABLE)

    def help_of(module: str) -> tuple[str, int, str]:
        result = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                                timeout=120)
        return module, result.returncode, result.stdout + result.stderr

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(help_of, RUNNABLE))
    broken = [f"{module} (exit {code}): {output.strip().splitlines()[-1:]}" for module, code, output in results
              if code != 0 or "usage:" not in output]
    assert not broken, broken
