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

from omni_ext.progress import ENV as PROGRESS_ENV

if TYPE_CHECKING:
    import psutil


#: Ports this process has handed out (never twice: two servers started in one go must not share one).
_HANDED_OUT: set[int] = set()
#: The text a server logs when a port it was given is taken (uvicorn, ZMQ and vLLM-Omni's master server).
PORT_TAKEN = "address already in use"


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for binds to port 0 (``/proc/sys/net/ipv4/ip_local_port_range``)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free port from BELOW the kernel's ephemeral range, never handed out twice by this process.

    Why not a bind to port 0: that port comes from the ephemeral range, and any process's next bind
    to port 0 (a ZMQ socket, an outgoing connection) may get it again before the server binds it;
    a fresh machine's first test run went red that way. Below the range only an explicit bind can
    take it. A server that still loses its port exits with :data:`PORT_TAKEN` in its log, and
    :meth:`ServeProcess.wait_ready` / :meth:`MultiHostServer.wait_ready` start it again on another.
    """
    import random

    lo, _ = ephemeral_range()
    first = max(1024, lo - 12000)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(first, lo)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port found in {first}-{lo - 1}")


def lost_port(log_text: str) -> bool:
    """Whether a server log says a port it was given was taken before it could bind it."""
    return PORT_TAKEN in log_text.lower()


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


class PortTaken(ServerStartError):
    """A server's log says a port it was given was taken before it bound it."""


@dataclass
class ServeProcess:
    model: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # "{port}" in a value becomes the server's port
    port: int = 0
    log_path: Path | None = None
    host: str = "127.0.0.1"
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None
    #: A headless replica (``--headless``, multi-machine mode): no HTTP port, never "healthy".
    headless: bool = False
    #: The HTTP port was chosen here (not given): a start that loses it is retried on another.
    auto_port: bool = False

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
        if self.headless:
            return [vllm_omni_exe(), "serve", self.model, "--omni", "--headless", *self.args]
        return [vllm_omni_exe(), "serve", self.model, "--omni", "--host", self.host, "--port", str(self.port), *self.args]

    def start(self) -> "ServeProcess":
        if not self.port and not self.headless:
            self.port, self.auto_port = free_port(), True
        if self.log_path is None:
            self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"omni-ext-serve-{self.port or os.getpid()}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Each server picks its own progress and placement directory (omni_ext.progress), never its caller's.
        env = {**{k: v for k, v in os.environ.items() if k != PROGRESS_ENV}, "HF_HUB_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1", **{k: v.replace("{port}", str(self.port)) for k, v in self.env.items()}}
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

    def wait_ready(self, timeout: float = 300.0, port_retries: int = 3) -> "ServeProcess":
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = self.proc.poll() is not None
            # A port taken during start-up: the HTTP port (the process exits) or a port vLLM-Omni picks
            # itself, such as torch.distributed's master port, whose loss may leave the process up but
            # never healthy. Either way a start on fresh ports is the cure.
            if (self.auto_port and port_retries > 0 and (exited or not self.healthy())
                    and lost_port(self.log_text())):
                if not exited:
                    self.stop()
                taken, log = self.port, self.log_path
                if log is not None:  # keep the failed start's log beside the new one
                    log.replace(log.with_name(f"{log.stem}.port-{taken}-taken{log.suffix}"))
                self.port = free_port()
                self.start()
                print(f"[server] a port was taken before vllm-omni serve bound it (HTTP port {taken}); started "
                      f"again on {self.port}", file=sys.stderr)
                return self.wait_ready(max(1.0, deadline - time.monotonic()), port_retries - 1)
            if exited:
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


#: What the head logs when a headless replica has joined and can be sent work.
ATTACHED_LINE = "attached remote replica"
#: How long a multi-machine head may take to exit on SIGTERM before its process group is SIGKILLed.
#: vLLM-Omni 0.30's head cannot shut down cleanly: the orchestrator's ``run()`` gathers the membership
#: watcher, whose loop ends only on ``MembershipController._shutdown_event``, which only ``run()``'s
#: ``finally`` (after that gather) sets. ``AsyncOmni.shutdown`` gives up joining the orchestrator thread
#: after 30 s and its stages are never shut down, so any wait only delays the kill that ends it anyway
#: (every multi-machine test spent 30 s here); the grace lets the head log its shutdown.
HEAD_STOP_GRACE_S = 3.0


@dataclass
class MultiHostServer:
    """vLLM-Omni's multi-machine mode on loopback: a head (``--stage-id 0``, the HTTP endpoint, with its
    own local replica) and ``replicas`` headless replicas (``--headless``), as on separate hosts.

    ``args``/``env`` go to every process; ``head_args``/``head_env`` to the head only. Ready when the head
    answers ``/health`` and has attached every headless replica. The same commands run across hosts
    with a routable ``--omni-master-address`` (``omni-ext presets render NAME --role head|replica``).
    """

    model: str
    replicas: int = 1
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    head_args: list[str] = field(default_factory=list)
    head_env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    master_port: int = 0
    head: ServeProcess | None = None
    headless: list[ServeProcess] = field(default_factory=list)
    restarts: int = 0
    _auto_master: bool = False

    def master_args(self) -> list[str]:
        return ["--stage-id", "0", "--omni-master-address", "127.0.0.1", "--omni-master-port", str(self.master_port)]

    def _replica(self, index: int) -> ServeProcess:
        name = f"replica{index}" + (f"-restart{self.restarts}" if self.restarts else "")
        return ServeProcess(model=self.model, args=[*self.args, *self.master_args(), "--worker-backend", "multi_process"],
                            env=self.env, headless=True,
                            log_path=(self.log_dir / f"{name}.log") if self.log_dir else None)

    def start(self) -> "MultiHostServer":
        if not self.master_port:
            self.master_port, self._auto_master = free_port(), True
        self.head = ServeProcess(model=self.model, args=[*self.args, *self.master_args(), *self.head_args],
                                 env={**self.env, **self.head_env},
                                 log_path=(self.log_dir / "head.log") if self.log_dir else None).start()
        self.headless = [self._replica(i).start() for i in range(self.replicas)]
        return self

    @property
    def url(self) -> str:
        assert self.head is not None, "start() first"
        return self.head.url

    @property
    def log_path(self) -> Path | None:
        """The head's log (the API process: what a client's requests and the dispatch write)."""
        return self.head.log_path if self.head is not None else None

    @property
    def ready_after_s(self) -> float | None:
        return self.head.ready_after_s if self.head is not None else None

    def attached(self) -> int:
        """Headless replicas the head has attached so far (rejoins count again)."""
        return self.head.log_text().count(ATTACHED_LINE) if self.head is not None else 0

    def wait_attached(self, count: int, timeout: float, watch: list[ServeProcess] | None = None) -> None:
        """Until the head has attached ``count`` replicas; fails early when the head or a process of
        ``watch`` (default: every headless replica) exits meanwhile."""
        deadline = time.monotonic() + timeout
        while self.attached() < count:
            if self.head is not None and lost_port(self.head.log_text()):
                raise PortTaken(f"the head lost a port (HTTP {self.head.port} or master {self.master_port}):\n"
                                f"{self.head.log_tail()}")
            for p in [self.head, *(self.headless if watch is None else watch)]:
                if p is not None and p.proc is not None and p.proc.poll() is not None:
                    raise ServerStartError(f"{p.log_path}: exited with {p.proc.returncode} during start-up:\n{p.log_tail()}")
            if time.monotonic() > deadline:
                raise ServerStartError(f"head attached {self.attached()} of {count} replica(s) after {timeout:.0f} s; "
                                       f"log {self.head.log_path if self.head else '?'}")
            time.sleep(0.5)

    def replica_id(self, index: int) -> int | None:
        """The replica id the head gave headless replica ``index`` (from its own log), once registered."""
        import re

        found = re.findall(r"Stage 0 replica (\d+) registered", self.headless[index].log_text())
        return int(found[-1]) if found else None

    def live(self) -> list[ServeProcess]:
        return [p for p in self.headless if p.proc is not None and p.proc.poll() is None]

    def wait_ready(self, timeout: float = 600.0, port_retries: int = 3) -> "MultiHostServer":
        """Until the head answers and every replica joined. A head that lost its HTTP or master port
        (taken before it bound it) is started again, with its replicas, on new ports."""
        assert self.head is not None, "start() first"
        t0 = time.monotonic()
        try:
            self.head.wait_ready(timeout, port_retries=0)
            self.wait_attached(self.replicas, max(10.0, timeout - (time.monotonic() - t0)))
        except ServerStartError:
            if not (port_retries > 0 and self.head.auto_port and self._auto_master and lost_port(self.head.log_text())):
                raise
            print(f"[server] the head lost port {self.head.port} or {self.master_port}; starting again on new ports",
                  file=sys.stderr)
            self.stop()
            if self.head.log_path is not None:
                self.head.log_path.replace(self.head.log_path.with_suffix(f".port-taken-{port_retries}.log"))
            self.master_port, self.head = 0, None
            self.start()
            return self.wait_ready(max(10.0, timeout - (time.monotonic() - t0)), port_retries - 1)
        return self

    def kill_replica(self, index: int) -> None:
        """SIGKILL a headless replica's whole process group (its host going away)."""
        proc = self.headless[index].proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)

    def restart_replica(self, index: int, timeout: float = 300.0) -> None:
        """Start replica ``index`` again and wait until the head has attached it."""
        before = self.attached()
        self.restarts += 1
        self.headless[index] = self._replica(index).start()
        self.wait_attached(before + 1, timeout, watch=[self.headless[index]])

    def stop(self) -> None:
        """Stops every process at once; the head gets :data:`HEAD_STOP_GRACE_S`, then SIGKILL (see there)."""
        from concurrent.futures import ThreadPoolExecutor

        procs = [p for p in [*self.headless, self.head] if p is not None]
        with ThreadPoolExecutor(max(1, len(procs))) as ex:
            list(ex.map(lambda p: p.stop(timeout=HEAD_STOP_GRACE_S if p is self.head else 30.0), procs))

    def __enter__(self) -> "MultiHostServer":
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
