"""HTTP conformance under attack tools: HTTPWookiee (reverse-proxy mode) and smuggler (default and
doubles configs), against gridgate and, side by side, nginx as a reverse proxy (docs/conformance.md).

    make conformance                  # everything that is installed
    python -m loadtest.conformance --tools smuggler --targets gridgate

The tools are not vendored. Point ``HTTPWOOKIEE_DIR`` and ``SMUGGLER_DIR`` at checkouts of
github.com/regilero/HTTPWookiee and github.com/defparam/smuggler; HTTPWookiee needs ``termcolor`` and
``six`` in ``HTTPWOOKIEE_PYTHON`` (default: this Python); nginx comes from ``NGINX`` or the PATH. What is
missing is skipped with a message saying why. Everything listens on loopback only.

How the tools are pointed at gridgate: gridgate routes a request by its capability, so the tools'
requests get one more header, ``X-Model: conformance`` (HTTPWookiee: added by a wrapper to every request
it builds; smuggler: a copy of each config with that header line in its template, run beside the
unchanged config). Without it every request would be refused before reaching the backend and the
tools would measure nothing. The upstream is HTTPWookiee's own backend thread, or the mock provider
for smuggler.

Results: a summary per tool and target on stdout and in loadtest/reports/conformance.json; the exit
status is 1 when gridgate has a Critical HTTPWookiee finding, forwarded crap, a split response or a
potential desync.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import yaml

from loadtest.mock_provider import start_mock_provider_process
from loadtest.report import REPORTS_DIR
from loadtest.topology import GatewayProcess, Topology, free_port, http_get

MODEL = "conformance"
TARGETS = ("gridgate", "nginx")
TOOLS = ("httpwookiee", "smuggler")
SMUGGLER_CONFIGS = ("default", "doubles")

# Run inside HTTPWookiee's own Python: adds the capability header to every request the tool builds and
# records each test's outcome (status, gravity) as one JSON line.
_WOOKIEE_WRAPPER = '''
import json, os, runpy, sys
home = os.environ["HTTPWOOKIEE_DIR"]
sys.path.insert(0, home)
from httpwookiee.http import request as wookiee_request
from httpwookiee.core import result as wookiee_result

_init = wookiee_request.Request.__init__
def _init_with_capability(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.add_header("X-Model", os.environ["WOOKIEE_MODEL"])
wookiee_request.Request.__init__ = _init_with_capability

def _recording(kind):
    original = getattr(wookiee_result.TextStatusResult, kind)
    def record(self, test, *rest):
        original(self, test, *rest)
        line = {"test": str(test), "outcome": kind[3:].lower(), "status": getattr(test, "status", None),
                "gravity": test.getGravity(True) if hasattr(test, "getGravity") else None}
        with open(os.environ["WOOKIEE_RESULTS"], "a") as out:
            out.write(json.dumps(line) + "\\n")
    setattr(wookiee_result.TextStatusResult, kind, record)
for kind in ("addSuccess", "addFailure", "addError", "addSkip"):
    _recording(kind)

sys.argv = [os.path.join(home, "httpwookiee.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
'''

_NGINX_CONF = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 512; }}
http {{
    access_log off;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream backend {{ server 127.0.0.1:{backend}; keepalive 8; }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""


# -- targets ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def gridgate(work: str, backend: int) -> Iterator[int]:
    """A one-worker gateway on a free port whose one provider is ``backend``; yields its port."""
    port, admin = free_port(), free_port()
    with open(os.path.join(work, "overlay.json"), "w") as out:
        json.dump({"local_site": "conformance", "candidates": [
            {"kind": "inference_model", "name": MODEL, "site": "conformance", "cluster": "backend"}]}, out)
    config = {
        "listen": f"127.0.0.1:{port}", "workers": 1, "admin": {"listen": f"127.0.0.1:{admin}"},
        "clusters": [{"name": "backend", "endpoints": [f"127.0.0.1:{backend}"]}],
        "routing": {"overlay_file": "overlay.json"},
        "access_log": {"enabled": False},
    }
    path = os.path.join(work, "gridgate.yaml")
    with open(path, "w") as out:
        yaml.safe_dump(config, out)
    gateway = GatewayProcess(Topology.from_config(path), None, None, log_name=f"conformance-gateway-{port}.log")
    try:
        gateway.wait_ready()
        yield port
    finally:
        gateway.stop()


@contextlib.contextmanager
def nginx(work: str, backend: int) -> Iterator[int]:
    """nginx as a plain reverse proxy (HTTP/1.1 and keep-alive upstream) to ``backend``; yields its port."""
    port = free_port()
    conf = os.path.join(work, "nginx.conf")
    with open(conf, "w") as out:
        out.write(_NGINX_CONF.format(dir=work, backend=backend, port=port))
    log = open(os.path.join(work, "nginx.log"), "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen([nginx_binary(), "-c", conf, "-p", work], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while http_get(("127.0.0.1", port), "/", timeout=0.5)[0] == 0:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: see {work}/nginx.log")
            time.sleep(0.1)
        yield port
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def target(name: str, work: str, backend: int):
    return gridgate(work, backend) if name == "gridgate" else nginx(work, backend)


# -- tools --------------------------------------------------------------------------------------------

def nginx_binary() -> str | None:
    return os.environ.get("NGINX") or shutil.which("nginx")


def wookiee_python() -> str:
    return os.environ.get("HTTPWOOKIEE_PYTHON") or sys.executable


def missing(tool: str) -> str | None:
    """Why ``tool`` cannot run here, or None."""
    if tool == "nginx":
        return None if nginx_binary() else "nginx not found (set NGINX or install it)"
    variable = "HTTPWOOKIEE_DIR" if tool == "httpwookiee" else "SMUGGLER_DIR"
    home = os.environ.get(variable)
    entry = "httpwookiee.py" if tool == "httpwookiee" else "smuggler.py"
    if not home or not os.path.isfile(os.path.join(home, entry)):
        return f"{variable} does not point at a checkout of {tool} (no {entry})"
    if tool == "httpwookiee":
        check = subprocess.run([wookiee_python(), "-c", "import termcolor, six"], capture_output=True)
        if check.returncode:
            return f"{wookiee_python()} lacks termcolor or six (set HTTPWOOKIEE_PYTHON, or pip install termcolor six)"
    return None


def run_httpwookiee(target_name: str, work: str) -> dict[str, Any]:
    """HTTPWookiee's reverse-proxy tests (``-m server``): its backend thread is the target's upstream."""
    backend = free_port()
    results = os.path.join(work, "wookiee-results.jsonl")
    wrapper = os.path.join(work, "wookiee_wrapper.py")
    with open(wrapper, "w") as out:
        out.write(_WOOKIEE_WRAPPER)
    with target(target_name, work, backend) as port:
        conf = os.path.join(work, "wookiee.conf")
        with open(conf, "w") as out:
            out.write("[main]\nDEBUG: false\nSERVER_HOST: localhost\nSERVER_IP: 127.0.0.1\n"
                      f"SERVER_PORT: {port}\nSERVER_SSL: false\nBACKEND_PORT: {backend}\nBACKEND_LOCATION: /\n"
                      "SERVER_DEFAULT_LOCATION: /\nCLIENT_SOCKET_READ_TIMEOUT_MS: 1000\n"
                      "I_HAVE_READ_AND_UNDERSTAND_THE_FAQ_AND_I_AM_RESPONSIBLE_OF_MY_ACTS: true\n")
        env = {**os.environ, "HTTPWOOKIEE_CONF": conf, "WOOKIEE_RESULTS": results, "WOOKIEE_MODEL": MODEL}
        with open(os.path.join(work, "httpwookiee.log"), "wb") as log:
            subprocess.run([wookiee_python(), wrapper, "-m", "server", "-V"], cwd=os.environ["HTTPWOOKIEE_DIR"],
                           env=env, stdout=log, stderr=subprocess.STDOUT, timeout=4 * 3600)
    with open(results) as lines:
        tests = [json.loads(line) for line in lines]
    failed = [t for t in tests if t["outcome"] in ("failure", "error")]
    return {
        "tests": len(tests),
        "failed": len(failed),
        "by_gravity": dict(Counter(t["gravity"] for t in failed)),
        "critical": sorted(t["test"] for t in failed if t["gravity"] == "Critical"),
        "forwarded_crap": sorted(t["test"] for t in tests if t["status"] == "Transmit^!$#^"),
        "split_responses": sorted(t["test"] for t in tests if t["status"] == "Splitted"),
        "statuses": dict(Counter(t["status"] for t in tests)),
        "failures": sorted(f"{t['test']}: {t['status']} [{t['gravity']}]" for t in failed),
        "log": os.path.join(work, "httpwookiee.log"),
    }


def smuggler_config(work: str, name: str, with_capability: bool) -> str:
    """The config as smuggler ships it, or a copy whose template also sends the capability header. A
    ``./`` path: smuggler reads any path whose second character is ``/`` as it is."""
    source = os.path.join(os.environ["SMUGGLER_DIR"], "configs", f"{name}.py")
    with open(source) as src:
        script = src.read()
    if with_capability:
        host_line = 'p.header += "Host: __HOST__" + RN'
        assert host_line in script, f"{source}: its template changed; update loadtest/conformance.py"
        script = script.replace(host_line, host_line + f'\n\tp.header += "X-Model: {MODEL}" + RN')
    filename = f"{name}{'-capability' if with_capability else ''}.py"
    with open(os.path.join(work, filename), "w") as out:
        out.write(script)
    return "./" + filename


_SMUGGLER_LINE = re.compile(r"^\[(?P<name>[^\]]+)\]\s*: (?P<outcome>.+)$")
_SMUGGLER_OK = re.compile(r"OK \(TECL: [\d.]+ - (?P<tecl>.*?)\) \(CLTE: [\d.]+ - (?P<clte>.*?)\)")


def parse_smuggler_log(path: str) -> dict[str, Any]:
    """Every mutation's outcome in a smuggler log: OK (with the two statuses answered), a potential
    desync, a timeout on both lengths, a disconnect or a socket error."""
    outcomes: Counter[str] = Counter()
    answered: Counter[str] = Counter()
    findings = []
    with open(path, errors="replace") as text:
        for line in text:
            match = _SMUGGLER_LINE.match(line.strip())
            if match is None or match["name"] == "CRITICAL":
                continue
            outcome = match["outcome"]
            ok = _SMUGGLER_OK.match(outcome)
            if ok:
                outcomes["ok"] += 1
                answered.update([ok["tecl"].strip() or "none", ok["clte"].strip() or "none"])
            elif "Issue Found" in outcome:
                outcomes["potential_desync"] += 1
                findings.append(f"{match['name']}: {outcome}")
            else:
                outcomes[outcome.lower()] += 1
    return {"mutations": sum(outcomes.values()), "potential_desync": outcomes["potential_desync"],
            "outcomes": dict(outcomes), "statuses_answered": dict(answered), "findings": findings}


def run_smuggler(target_name: str, work: str) -> dict[str, Any]:
    """smuggler's default and doubles configs, each as shipped and with the capability header."""
    mock = start_mock_provider_process(0, "conformance")
    runs: dict[str, Any] = {}
    try:
        with target(target_name, work, mock.port) as port:
            for name in SMUGGLER_CONFIGS:
                for with_capability in (False, True):
                    config = smuggler_config(work, name, with_capability)
                    log = os.path.join(work, f"smuggler-{config[2:-3]}.log")
                    started = time.monotonic()
                    subprocess.run(
                        [sys.executable, os.path.join(os.environ["SMUGGLER_DIR"], "smuggler.py"),
                         "-u", f"http://127.0.0.1:{port}/v1/chat/completions", "-c", config, "--no-color",
                         "-t", os.environ.get("SMUGGLER_TIMEOUT", "5"), "-l", log],
                        cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=4 * 3600,
                    )
                    runs[config[2:-3]] = {**parse_smuggler_log(log), "seconds": round(time.monotonic() - started),
                                          "log": log}
    finally:
        mock.stop()
    return runs


# -- main ---------------------------------------------------------------------------------------------

def verdict(results: dict[str, Any]) -> list[str]:
    """What disqualifies gridgate: Critical findings, forwarded crap, split responses, potential desyncs."""
    problems = []
    wookiee = results.get("httpwookiee", {}).get("gridgate")
    if isinstance(wookiee, dict):
        for key in ("critical", "forwarded_crap", "split_responses"):
            problems += [f"httpwookiee {key}: {name}" for name in wookiee[key]]
    smuggler = results.get("smuggler", {}).get("gridgate")
    if isinstance(smuggler, dict):
        for config, run in smuggler.items():
            problems += [f"smuggler {config}: {finding}" for finding in run["findings"]]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", default=",".join(TOOLS), help="comma-separated: httpwookiee, smuggler")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: gridgate, nginx")
    parser.add_argument("--out", default=os.path.join(REPORTS_DIR, "conformance.json"))
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for tool in args.tools.split(","):
        results[tool] = {}
        why = missing(tool)
        if why:
            print(f"skipped {tool}: {why}")
            results[tool] = {"skipped": why}
            continue
        for name in args.targets.split(","):
            why = missing(name) if name == "nginx" else None
            if why:
                print(f"skipped {tool} against {name}: {why}")
                results[tool][name] = {"skipped": why}
                continue
            print(f"running {tool} against {name} ...", flush=True)
            work = tempfile.mkdtemp(prefix=f"conformance-{tool}-{name}-")
            run = run_httpwookiee if tool == "httpwookiee" else run_smuggler
            results[tool][name] = run(name, work)
            print(json.dumps(results[tool][name], indent=1)[:3000], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as out:
        json.dump(results, out, indent=1)
    problems = verdict(results)
    print(f"results: {args.out}")
    for problem in problems:
        print(f"gridgate: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
