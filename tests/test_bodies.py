"""Request bodies in memory and slow clients (:mod:`omni_ext.api.bodies`): the rules alone, uvicorn's protocol
with and without the header time-out in process, and the real server under slow and large uploads."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from omni_ext.api import limits
from omni_ext.api.bodies import (
    BodyLimits, MemoryBudget, header_timeout_protocol, load_body_limits, next_read_wait, read_body, reservation,
)
from omni_ext.api.errors import APIError
from tests.helpers import auth

MiB = 2**20


# ---- the rules --------------------------------------------------------------------------------------
def test_reservation_is_the_declared_length_or_the_upload_limit() -> None:
    assert reservation("1234", 32 * MiB) == 1234
    assert reservation(None, 32 * MiB) == 32 * MiB  # chunked: the most it may be
    with pytest.raises(APIError) as big:
        reservation(str(32 * MiB + 1), 32 * MiB)
    assert (big.value.status, big.value.code) == (413, "request_too_large")
    for bad in ("abc", "-1"):
        with pytest.raises(APIError) as err:
            reservation(bad, 32 * MiB)
        assert (err.value.status, err.value.code) == (400, "invalid_header")


def test_next_read_wait_bounds_silence_and_the_whole_body() -> None:
    lim = BodyLimits(body_timeout_s=30, min_rate=64 * 1024)
    assert next_read_wait(lim, 0.0, 0, 0.0) == 30  # silence: at most the time-out
    assert next_read_wait(lim, 0.0, 64 * 1024 * 100, 10.0) == 30  # a fast body: only silence is bounded
    assert next_read_wait(lim, 0.0, 100, 29.0) == pytest.approx(1.0, abs=0.01)  # a trickle runs out of time
    assert next_read_wait(lim, 0.0, 100, 31.0) < 0
    assert next_read_wait(BodyLimits(body_timeout_s=30, min_rate=0), 0.0, 0, 1000.0) == 30  # no rate rule
    assert next_read_wait(BodyLimits(body_timeout_s=0), 0.0, 0, 1000.0) is None  # no time-out at all


def test_load_body_limits_reads_config_and_env_and_refuses_a_budget_under_one_upload() -> None:
    lim = load_body_limits({"max_body_memory_mb": 64, "body_wait_s": 2}, {"OMNI_EXT_API_HEADER_TIMEOUT_S": "5"}, 32 * MiB)
    assert lim == BodyLimits(memory_bytes=64 * MiB, wait_s=2, header_timeout_s=5,
                             body_timeout_s=limits.BODY_TIMEOUT_S, min_rate=limits.BODY_MIN_RATE_KIB_S * 1024)
    assert load_body_limits({}, {}, 32 * MiB) == BodyLimits()
    with pytest.raises(ValueError, match="smaller than one upload"):
        load_body_limits({"max_body_memory_mb": 16}, {}, 32 * MiB)
    with pytest.raises(ValueError, match="0 or more"):
        load_body_limits({}, {"OMNI_EXT_API_BODY_TIMEOUT_S": "-1"}, 32 * MiB)
    with pytest.raises(ValueError, match="must be a number"):
        load_body_limits({"body_wait_s": "soon"}, {}, 32 * MiB)


def test_memory_budget_first_come_first_served_then_refused() -> None:
    async def scenario() -> None:
        budget = MemoryBudget(100)
        a = budget.try_take(60)
        assert a is not None and budget.in_use == 60
        big = asyncio.ensure_future(budget.take(50, wait_s=5))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(budget.take(10, wait_s=5))  # would fit, but waits behind the big one
        await asyncio.sleep(0.01)
        assert budget.waiting == 2 and budget.in_use == 60 and not small.done()
        a.release()
        got_big, got_small = await big, await small
        assert got_big is not None and got_small is not None and budget.in_use == 60 and budget.peak == 60
        assert (await budget.take(50, wait_s=0.05)) is None  # no room came: refused
        assert budget.refused_total == 1 and budget.waiting == 0 and budget.waited_total == 3
        waiter = asyncio.ensure_future(budget.take(50, wait_s=5))
        await asyncio.sleep(0.01)
        waiter.cancel()  # its request went away: it leaves the line
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert budget.waiting == 0
        got_big.shrink(20)
        got_small.release()
        got_small.release()  # again: nothing more
        assert budget.in_use == 20
        got_big.release()
        assert budget.in_use == 0 and budget.peak == 60

    asyncio.run(scenario())


def test_read_body_cuts_off_a_trickle_and_a_body_over_the_limit() -> None:
    lim = BodyLimits(body_timeout_s=0.3, min_rate=1000)

    def trickle(pieces: int, gap: float, size: int = 1):
        sent = 0

        async def receive() -> dict:
            nonlocal sent
            await asyncio.sleep(gap)
            sent += 1
            return {"type": "http.request", "body": b"x" * size, "more_body": sent < pieces}

        return receive

    assert asyncio.run(read_body(trickle(3, 0.01, 10), lim, 1000)) == b"x" * 30
    with pytest.raises(APIError) as slow:  # a byte every 0.1 s: within the silence bound, not the rate
        asyncio.run(read_body(trickle(100, 0.1), lim, 1000))
    assert (slow.value.status, slow.value.code) == (408, "request_timeout")
    with pytest.raises(APIError) as silent:
        asyncio.run(read_body(trickle(2, 1.0), lim, 1000))
    assert silent.value.status == 408
    with pytest.raises(APIError) as big:
        asyncio.run(read_body(trickle(5, 0.0, 400), lim, 1000))
    assert big.value.status == 413


# ---- headers: uvicorn's protocol in process --------------------------------------------------------------
async def _hello(scope, receive, send) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _serve_and_trickle(protocol: type | None, trickle_s: float) -> tuple[bytes, bool, bytes]:
    """An in-process uvicorn (its httptools protocol, or ``protocol``); a client that sends a header byte every
    0.1 s for ``trickle_s``, and one that sends two requests on a keep-alive connection 0.3 s apart. Returns
    what the trickler got, whether its connection was still open at the end, and the keep-alive answers."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(_hello, http=protocol or "httptools", lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        got, open_ = b"", True
        deadline = time.monotonic() + trickle_s
        while time.monotonic() < deadline:
            try:
                writer.write(b"a")
                await writer.drain()
            except ConnectionError:
                break
            try:
                chunk = await asyncio.wait_for(reader.read(4096), 0.1)
            except asyncio.TimeoutError:
                continue
            got += chunk
            if not chunk:
                break
        try:
            open_ = not reader.at_eof() and (await asyncio.wait_for(reader.read(1), 0.05)) != b""
        except asyncio.TimeoutError:
            open_ = True
        writer.close()
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = await asyncio.wait_for(r2.read(4096), 2)
        await asyncio.sleep(0.3)
        w2.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answers += await asyncio.wait_for(r2.read(4096), 2)
        w2.close()
        return got, open_, answers
    finally:
        server.should_exit = True
        await task


def test_header_trickle_bug_and_fix() -> None:
    """uvicorn's httptools protocol (vLLM's choice) keeps a connection whose headers never end; with the header
    time-out (the ``http-header-timeout`` patch hands uvicorn this protocol) it is answered 408 and closed,
    while a keep-alive client's requests are served as before."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    got, still_open, answers = asyncio.run(_serve_and_trickle(None, 1.5))
    assert got == b"" and still_open  # the bug: 1.5 s of trickling and nothing happened
    assert answers.count(b"HTTP/1.1 200") == 2

    got, still_open, answers = asyncio.run(_serve_and_trickle(header_timeout_protocol(HttpToolsProtocol, 0.5), 1.5))
    assert got.startswith(b"HTTP/1.1 408") and not still_open
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert answers.count(b"HTTP/1.1 200") == 2  # a request 0.3 s after a response: under the time-out, served


# ---- the real server ------------------------------------------------------------------------------------
class RawClient:
    """One HTTP/1.1 connection written by hand: a slow client, or one that holds its body back."""

    def __init__(self, server, head: bytes) -> None:
        self.sock = socket.create_connection((server.host, server.port), timeout=90)
        self.sock.sendall(head)
        self.stop = threading.Event()

    def trickle(self, every_s: float, byte: bytes = b"a") -> threading.Thread:
        def run() -> None:
            while not self.stop.wait(every_s):
                try:
                    self.sock.sendall(byte)
                except OSError:
                    return

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def response(self) -> tuple[int, dict[str, str], bytes, float]:
        """The answer (status, headers, body) and when it came (monotonic); the connection closes after it."""
        data = b""
        while True:
            try:
                chunk = self.sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            data += chunk
        when = time.monotonic()
        self.stop.set()
        self.sock.close()
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1]) if lines and lines[0].startswith("HTTP/") else 0
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        return status, headers, body, when


def _post_head(server, length: int, path: str = "/v1/videos") -> bytes:
    key = auth(server)["Authorization"]
    return (f"POST {path} HTTP/1.1\r\nHost: {server.host}:{server.port}\r\nAuthorization: {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def _info(server) -> dict:
    r = requests.get(server.url + "/v1/omni_ext/info", headers=auth(server), timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["bodies"]


def _job_ids(server) -> list[str]:
    r = requests.get(server.url + "/v1/videos", params={"limit": 100}, headers=auth(server), timeout=10)
    assert r.status_code == 200, r.text
    return [j["id"] for j in r.json()["data"]]


def test_slow_clients_cut_off_and_bodies_bounded_in_memory_while_others_are_served(server_pool) -> None:
    """On the real server with its default bounds (``wan-api``: 32 MiB uploads, 256 MiB of bodies in memory,
    10 s wait, 30 s header and body time-outs), at once:

    - a client that trickles its headers and one that trickles its body are cut off with 408 near 30 s;
    - seven uploads that declare 32 MiB and hold their bodies back fill 224 MiB of the budget and are cut off
      by the body time-out too;
    - meanwhile other clients are served: the info route, a small request (400 at once), and four 31 MiB
      uploads at full speed, which wait for room one after another and are all answered;
    - an upload that cannot fit waits 10 s and gets 503 ``server_busy`` with ``Retry-After``;
    - nothing any of them sent leaves a job behind, and the budget is empty again at the end."""
    server = server_pool.get("wan-api")
    before = _info(server)
    assert (before["max_upload_bytes"], before["max_body_memory_bytes"]) == (32 * MiB, limits.MAX_BODY_MEMORY_MB * MiB)
    assert (before["header_timeout_s"], before["body_timeout_s"], before["body_wait_s"]) == (
        limits.HEADER_TIMEOUT_S, limits.BODY_TIMEOUT_S, limits.BODY_WAIT_S)
    assert before["body_min_rate_bytes_s"] == limits.BODY_MIN_RATE_KIB_S * 1024 and before["in_use_bytes"] == 0
    jobs = _job_ids(server)
    started = time.monotonic()

    header_slow = RawClient(server, f"POST /v1/videos HTTP/1.1\r\nHost: {server.host}\r\nX-Slow: ".encode())
    header_slow.trickle(2.0)
    body_slow = RawClient(server, _post_head(server, 1000) + b'{"prompt": "')
    body_slow.trickle(2.0)
    holders = [RawClient(server, _post_head(server, 32 * MiB) + b'{"prompt": "') for _ in range(7)]
    deadline = time.monotonic() + 10
    while _info(server)["in_use_bytes"] < 7 * 32 * MiB + 1000 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _info(server)["in_use_bytes"] == 7 * 32 * MiB + 1000

    # others are served meanwhile: a small request at once ...
    t0 = time.monotonic()
    small = requests.post(server.url + "/v1/videos", json={"prompt": "", "seconds": "1"}, headers=auth(server), timeout=30)
    assert small.status_code == 400 and time.monotonic() - t0 < 5, small.text
    # ... and full-size uploads, which fit one at a time in the room left and wait for it
    waited = _info(server)["waited_total"]
    big_prompt = json.dumps({"prompt": "x" * (31 * MiB)})
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: requests.post(
            server.url + "/v1/videos", data=big_prompt, timeout=60,
            headers={**auth(server), "Content-Type": "application/json"}), range(4)))
    assert [a.status_code for a in answers] == [400] * 4, [a.text[:200] for a in answers]
    assert all(a.json()["error"]["param"] == "prompt" for a in answers)
    mid = _info(server)
    assert mid["waited_total"] > waited and mid["peak_bytes"] <= mid["max_body_memory_bytes"]
    assert mid["in_use_bytes"] == 7 * 32 * MiB + 1000  # theirs went back once each was refused

    # an upload that cannot fit waits, then is refused with a time to come back
    t0 = time.monotonic()
    too_big_for_the_room = json.dumps({"prompt": "x" * (32 * MiB - 100)})  # under the upload limit, over the room
    no_room = requests.post(server.url + "/v1/videos", data=too_big_for_the_room, timeout=60,
                            headers={**auth(server), "Content-Type": "application/json"})
    assert no_room.status_code == 503, no_room.text
    assert limits.BODY_WAIT_S - 0.5 <= time.monotonic() - t0 < limits.BODY_WAIT_S + 10
    assert no_room.json()["error"]["code"] == "server_busy" and int(no_room.headers["retry-after"]) >= 1
    assert _info(server)["refused_total"] == before["refused_total"] + 1

    # the slow ones are cut off near their time-outs
    results = {"header": header_slow.response(), "body": body_slow.response()}
    results.update({f"holder{i}": h.response() for i, h in enumerate(holders)})
    for name, (status, _headers, body, when) in results.items():
        assert status == 408, (name, status, body)
        assert json.loads(body)["error"]["code"] == "request_timeout", (name, body)
        assert limits.BODY_TIMEOUT_S - 1 <= when - started < limits.BODY_TIMEOUT_S + 15, (name, when - started)
    after = _info(server)
    assert after["timed_out_total"] >= before["timed_out_total"] + 8
    assert after["header_timed_out_total"] >= before["header_timed_out_total"] + 1
    assert after["in_use_bytes"] == 0 and after["waiting"] == 0
    assert _job_ids(server) == jobs  # nothing refused left a job behind
