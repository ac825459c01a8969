"""Layers import downward only: the supervisor, the CLI and `gridgate check` never load the data plane."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.harness import ROOT, candidate, envelope

# What only a worker may load: its event loop, the HTTP parser and every module of workers/.
DATA_PLANE = ("uvloop", "h11", "workers")


def data_plane(modules: set[str]) -> set[str]:
    return {m for m in modules if m in DATA_PLANE or m.startswith("workers.")}


def test_the_data_plane_names_are_real_modules():
    # A name that matches nothing would make the checks below pass whatever is loaded.
    modules = loaded_modules("import workers.main")
    assert set(DATA_PLANE) <= modules
    assert {"workers.server", "workers.proxy", "workers.upstream"} <= data_plane(modules)


def loaded_modules(program: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``program`` (which must not print)."""
    script = f"{program}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_importing_the_supervisor_and_the_cli_loads_no_data_plane():
    modules = loaded_modules("import gateway.supervisor, gateway.cli")
    assert not data_plane(modules) and "valkey" not in modules


def test_the_supervisor_process_code_loads_no_data_plane():
    # What `gridgate run` imports in the supervisor before it forks: children import theirs after.
    modules = loaded_modules("import gateway.supervisor.arbiter")
    assert not data_plane(modules) - {"h11"} and "valkey" not in modules


def test_gridgate_check_loads_no_data_plane(tmp_path):
    (tmp_path / "overlay.json").write_text(json.dumps(envelope([candidate("m", "cluster-a")])))
    (tmp_path / "gw.yaml").write_text(
        "clusters: [{name: cluster-a, endpoints: ['127.0.0.1:9']}]\nrouting: {overlay_file: overlay.json}\n"
        "quota: {backend: {kind: valkey, url: 'valkey://127.0.0.1:6379/0'}, "
        "rules: [{name: all, budgets: [{window: 1m, tokens: 1000}]}]}\n"
    )
    program = (
        "import contextlib, io\n"
        "from gateway.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        f"    assert main(['check', '-c', {str(tmp_path / 'gw.yaml')!r}]) == 0\n"
        "assert out.getvalue() == 'ok\\n'\n"
    )
    modules = loaded_modules(program)
    assert not data_plane(modules) and "valkey" not in modules
