"""Helpers shared by the test modules that talk to real servers: requests as a client sends them,
and the TunedExecutor's placement as its log tells it."""

from __future__ import annotations

import base64
import re
import time

import requests

VIDEO = {"prompt": "a red fox running through fresh snow", "negative_prompt": "blurry, low quality",
         "num_inference_steps": "2", "guidance_scale": "4.0", "seed": "1234", "fps": "8"}
IMAGE = {"prompt": "a lighthouse at dusk", "negative_prompt": "blurry", "true_cfg_scale": 4.0,
         "num_inference_steps": 2, "seed": 77}


def video_sync(server, **fields) -> requests.Response:
    data = {**VIDEO, **{k: str(v) for k, v in fields.items()}}
    # multipart/form-data, exactly as vLLM-Omni's curl examples send it
    return requests.post(server.url + "/v1/videos/sync", files={k: (None, v) for k, v in data.items()}, timeout=300)


def image_gen(server, **fields) -> requests.Response:
    return requests.post(server.url + "/v1/images/generations", json={**IMAGE, **fields}, timeout=300)


def png_from(resp: requests.Response) -> bytes:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return base64.b64decode(body["data"][0]["b64_json"])


# The TunedExecutor's INFO lines: ``omni-ext: start request <id> on rank(s) [..] (<mode>)`` and
# ``omni-ext: done request <id> on rank(s) [..]``, in the order the server wrote them.
START = re.compile(r"omni-ext: start request (\S+) on rank\(s\) \[([\d, ]+)\] \((\w+(?:-\w+)?)\)")
DONE = re.compile(r"omni-ext: done request (\S+) on rank\(s\) \[([\d, ]+)\]")


def executor_events(log: str) -> list[tuple[str, str, tuple[int, ...], str]]:
    """("start"|"done", request_id, ranks, mode) in log order."""
    events = []
    for line in log.splitlines():
        m = START.search(line)
        if m:
            events.append(("start", m.group(1), tuple(int(x) for x in m.group(2).split(",")), m.group(3)))
            continue
        m = DONE.search(line)
        if m:
            events.append(("done", m.group(1), tuple(int(x) for x in m.group(2).split(",")), ""))
    return events


def new_events(server, before: int) -> list:
    return executor_events(server.log_text())[before:]


def wait_for_events(server, before: int, n_done: int, timeout: float = 60.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = new_events(server, before)
        if sum(1 for e in ev if e[0] == "done") >= n_done:
            return ev
        time.sleep(0.2)
    return new_events(server, before)
