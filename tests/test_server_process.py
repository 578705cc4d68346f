"""Test servers' ports: below the kernel's ephemeral range, never handed out twice, and a start that
loses its port to another process is retried on another one (a fresh machine's first run went red
when a bind to port 0 handed the multi-machine head's master port to someone else first)."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass

from omni_ext.server_process import ServeProcess, ephemeral_range, free_port, lost_port

# A stand-in for `vllm-omni serve` that does what matters here for real: bind the port, or die with
# the kernel's own error text when it is taken; then answer /health.
_HEALTH_SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@dataclass
class _HealthOnly(ServeProcess):
    def command(self) -> list[str]:
        return [sys.executable, "-c", _HEALTH_SERVER, str(self.port)]


def test_free_ports_come_from_below_the_ephemeral_range_and_never_twice() -> None:
    lo, _ = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= p < lo for p in ports)
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:  # and each was free when handed out
        s.bind(("127.0.0.1", ports[-1]))


def test_a_port_taken_before_the_server_binds_it_is_retried_on_another(tmp_path) -> None:
    proc = _HealthOnly(model="none", log_path=tmp_path / "s.log")
    proc.port, proc.auto_port = free_port(), True
    with socket.socket() as squatter:  # someone else binds the port first
        squatter.bind(("127.0.0.1", proc.port))
        squatter.listen()
        taken = proc.port
        try:
            proc.start().wait_ready(timeout=60)
            assert proc.port != taken and proc.healthy()
            assert lost_port((tmp_path / f"s.port-{taken}-taken.log").read_text())
        finally:
            proc.stop()


def test_a_given_port_is_not_silently_changed(tmp_path) -> None:
    from omni_ext.server_process import ServerStartError

    port = free_port()
    proc = _HealthOnly(model="none", port=port, log_path=tmp_path / "s.log")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        try:
            proc.start().wait_ready(timeout=60)
            raise AssertionError("a server given a taken port must fail, not move")
        except ServerStartError as exc:
            assert lost_port(str(exc))
        finally:
            proc.stop()


# Like vLLM-Omni's start when torch.distributed's master port (a port it picks itself) is taken: the
# first start fails to bind it, logs the kernel's error and hangs up but never healthy; a new start
# picks another master port (here: the marker file says it is not the first) and serves.
_HANGS_ON_MASTER_PORT = """
import http.server, os, socket, sys, time
port, master, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
if not os.path.exists(marker):
    open(marker, "w").close()
    try:
        socket.socket().bind(("127.0.0.1", master))
    except OSError as exc:
        print(f"The server socket has failed to listen on any local network address. port: {master}: {exc}", flush=True)
        time.sleep(3600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@dataclass
class _HangsOnMaster(ServeProcess):
    master: int = 0
    marker: str = ""

    def command(self) -> list[str]:
        return [sys.executable, "-c", _HANGS_ON_MASTER_PORT, str(self.port), str(self.master), self.marker]


def test_a_start_left_hanging_by_a_taken_master_port_is_stopped_and_retried(tmp_path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        proc = _HangsOnMaster(model="none", log_path=tmp_path / "s.log", master=squatter.getsockname()[1],
                              marker=str(tmp_path / "started-once"))
        proc.port, proc.auto_port = free_port(), True
        first = proc.port
        try:
            proc.start().wait_ready(timeout=60)
            assert proc.port != first and proc.healthy()
            assert lost_port((tmp_path / f"s.port-{first}-taken.log").read_text())
        finally:
            proc.stop()
