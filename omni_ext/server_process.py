"""Start, wait for and stop a real ``vllm-omni serve ... --omni`` process.

Used by the test suite, the benchmarks and the quickstart, which all need the same things: a free
port, a log file an operator can read, readiness detected from ``/health`` (not from sleeping), a
clear error with the log tail when the server dies during start-up, and a shutdown that takes the
worker processes down with it (the whole process group).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_omni_exe() -> str:
    """The ``vllm-omni`` console script next to this interpreter (the venv's), else PATH's."""
    local = Path(sys.executable).with_name("vllm-omni")
    if local.exists():
        return str(local)
    found = shutil.which("vllm-omni")
    if not found:
        raise FileNotFoundError("vllm-omni is not installed in this environment (run scripts/setup.sh)")
    return found


class ServerStartError(RuntimeError):
    pass


@dataclass
class ServeProcess:
    model: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    log_path: Path | None = None
    host: str = "127.0.0.1"
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        """The ``vllm-omni serve`` process (the API server; the engine and workers are its descendants)."""
        assert self.proc is not None, "start() first"
        return self.proc.pid

    def processes(self) -> list["psutil.Process"]:
        """The server's live process tree: the API process first, then every descendant (engine,
        workers, helpers), for resource checks (RSS, open files) by whoever runs it."""
        import psutil

        root = psutil.Process(self.pid)
        return [root, *root.children(recursive=True)]

    def command(self) -> list[str]:
        return [vllm_omni_exe(), "serve", self.model, "--omni", "--host", self.host, "--port", str(self.port), *self.args]

    def start(self) -> "ServeProcess":
        if not self.port:
            self.port = free_port()
        if self.log_path is None:
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"omni-ext-serve-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **self.env}
        log = open(self.log_path, "wb")
        log.write((" ".join(self.command()) + "\n").encode())
        log.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        return self

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])  # type: ignore[union-attr]
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")  # type: ignore[union-attr]
        except OSError:
            return ""

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    def wait_ready(self, timeout: float = 300.0) -> "ServeProcess":
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"vllm-omni serve exited with code {self.proc.returncode} during start-up; log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                self.ready_after_s = time.monotonic() - self.started_at
                return self
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(f"vllm-omni serve not ready after {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def __enter__(self) -> "ServeProcess":
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
