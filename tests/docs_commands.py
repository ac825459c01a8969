"""The shell blocks of the docs, as data, and the runner that executes them (tests/integration/test_docs_commands.py).

Every ```sh block of README.md and docs/*.md carries a marker on the line before it:

    <!-- docs-test: run -->                      run it as written, in a fresh checkout
    <!-- docs-test: run-in-sandbox -->           run it with `sudo` a no-op and $OPT / $ETC in a scratch
                                                 directory (the block must use those variables)
    <!-- docs-test: skip: <reason> -->           do not run it (systemd, the host's kernel, long benches)

and options after the mode, separated by ";": `needs: demo` (the demo topology `make run` serves must
be up: the runner starts it), `expect: <text>` (the block's output holds it; repeatable),
`exit: <n>` (the block's exit status, default 0). A block runs under `bash -e -o pipefail`, so every
command in it must succeed unless it is the last and `exit:` says otherwise.

The runner (``python -m tests.docs_commands PLAN.json``) runs one page's blocks in order, as a reader
would, starting the demo first when one of them needs it, and writes each block's exit status and
output next to the plan. The test runs it in a private network namespace when it can (`unshare`), so
the demo's fixed ports (8080, 9901, 9001-9003) never meet anything else on the machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SHELL_LANGUAGES = ("sh", "bash", "shell", "console")
_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
DEMO_PORTS = (8080, 9901, 9001, 9002, 9003)
DEMO_READY_TIMEOUT_S = 90.0
BLOCK_TIMEOUT_S = 60.0


@dataclass
class Block:
    page: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    text: str
    mode: str | None = None  # run | run-in-sandbox | skip; None: no marker
    reason: str = ""
    needs_demo: bool = False
    expect: list[str] = field(default_factory=list)
    exit_status: int = 0
    problem: str = ""  # a marker that does not parse

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def shell_blocks(root: Path, page: Path) -> list[Block]:
    """The shell blocks of one page with what their markers say."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if not fence:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].startswith("```")), len(lines))
        if fence.group(1) in SHELL_LANGUAGES:
            block = Block(str(page.relative_to(root)), index + 1, "\n".join(lines[index + 1:end]) + "\n")
            marker = _MARKER.match(lines[index - 1]) if index else None
            if marker:
                _read_marker(block, marker.group("body"))
            blocks.append(block)
        index = end + 1
    return blocks


def _read_marker(block: Block, body: str) -> None:
    if body.startswith("skip:"):
        block.mode, block.reason = "skip", body[len("skip:"):].strip()
        if not block.reason:
            block.problem = "skip needs a reason"
        return
    mode, *options = [part.strip() for part in body.split(";")]
    if mode not in ("run", "run-in-sandbox"):
        block.problem = f"unknown mode {mode!r} (run, run-in-sandbox or skip: <reason>)"
        return
    block.mode = mode
    for option in options:
        name, _, value = (part.strip() for part in option.partition(":"))
        if name == "needs" and value == "demo":
            block.needs_demo = True
        elif name == "expect" and value:
            block.expect.append(value)
        elif name == "exit" and value.isdigit():
            block.exit_status = int(value)
        else:
            block.problem = f"unknown option {option!r} (needs: demo, expect: <text>, exit: <n>)"


# --------------------------------------------------------------------------- the runner


def ports_in_use(ports: tuple[int, ...] = DEMO_PORTS) -> list[int]:
    busy = []
    for port in ports:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                busy.append(port)
    return busy


def _demo_ready() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 9901), timeout=0.5) as sock:
            sock.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            return sock.recv(16).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


class Demo:
    """`make run` in the checkout, in the background, until ``stop``."""

    def __init__(self, checkout: Path, env: dict[str, str], log: Path) -> None:
        self._log = open(log, "wb")  # noqa: SIM115 - the demo's output for its whole life
        self.process = subprocess.Popen(["make", "run"], cwd=checkout, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self) -> str | None:
        """None once the admin listener says ready, else why not."""
        deadline = time.monotonic() + DEMO_READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return f"make run exited with {self.process.returncode}"
            if _demo_ready():
                return None
            time.sleep(0.2)
        return f"the demo was not ready within {DEMO_READY_TIMEOUT_S:.0f}s"

    def stop(self) -> bool:
        """Ctrl-C, as a reader stops it (make and the demo get it; the demo forwards it to the gateway and
        waits for its drain). False if it had to be killed."""
        graceful = True
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(40)
            except subprocess.TimeoutExpired:
                graceful = False
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
        return graceful


def run_plan(plan_path: Path) -> None:
    """Run the blocks of a plan (written by the test) in order; results go to ``results.json`` beside it."""
    plan = json.loads(plan_path.read_text())
    out = plan_path.parent
    checkout = Path(plan["checkout"])
    env = dict(plan["env"])
    if plan["isolated"]:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    results: list[dict[str, object]] = []
    demo = None
    try:
        if any(block["needs_demo"] for block in plan["blocks"]):
            busy = ports_in_use()
            if busy:
                raise RuntimeError(f"the demo's ports {busy} are taken on this machine")
            demo = Demo(checkout, env, out / "demo.log")
            problem = demo.wait_ready()
            if problem:
                raise RuntimeError(problem)
        for number, block in enumerate(plan["blocks"]):
            script = out / f"block{number}.sh"
            script.write_text(block["text"])
            block_env = {**env, **block["env"]}
            try:
                done = subprocess.run(["bash", "-e", "-o", "pipefail", str(script)], cwd=checkout, env=block_env,
                                      stdin=subprocess.DEVNULL, capture_output=True, timeout=BLOCK_TIMEOUT_S)
                status, output = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as exc:
                status, output = -1, (exc.stdout or b"") + (exc.stderr or b"") + b"\n(timed out)"
            results.append({"status": status, "output": output.decode(errors="replace")})
    except RuntimeError as exc:
        results.append({"status": None, "output": str(exc)})
    finally:
        if demo is not None and not demo.stop():
            results.append({"status": None, "output": "make run did not stop within 40s of Ctrl-C"})
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    run_plan(Path(sys.argv[1]))

