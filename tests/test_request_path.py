"""The path of a ``POST /v1/videos`` through omni-ext's modules, traced (issue 16, item 3).

Every omni_ext function the route enters is recorded in order with ``sys.setprofile`` on a real
request to omni-ext's router (``serve_in_process``: the app without an engine), and the path is
counted the way a reader follows it: a *stay* is each time the path enters a file (consecutive
calls inside one file are one stay), a *return* is a stay in a file the path had already left.
The trace counts every call, properties and context-manager exits included, so it is stricter
than a reader; the bounds below are today's figures and fail on any regression. No start-up work
runs on the request path.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import omni_ext
from omni_ext.api.validation import ModelLimits
from tests.helpers import serve_in_process

ROOT = str(Path(omni_ext.__file__).parent) + "/"
WAN = ModelLimits("WanPipeline", 16, 1, True)
#: Functions that build state at start-up; none may run while a request is served.
START_UP = {"init_state", "request_queue", "load_settings", "limits_for_model", "resolve_video_backend",
            "configured_defaults", "native_video_defaults", "server_layout", "scheduler_config"}
MAX_STAYS, MAX_RETURNS = 33, 20


def trace_create_video(tmp_path: Path) -> list[tuple[str, list[str]]]:
    """(file under omni_ext/, functions entered there) per stay, for the second create of a server."""
    stays: list[tuple[str, list[str]]] = []
    state = {"on": False, "seen": 0}

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        ours = code.co_filename.startswith(ROOT)
        if ours and code.co_name == "create_video":
            if event == "call" and state["seen"] == 1:
                state["on"] = True
            elif event == "return" and state["on"]:
                state["on"] = False
            elif event == "return":
                state["seen"] += 1
        if not state["on"]:
            return
        where = code.co_filename if event == "call" else (frame.f_back.f_code.co_filename if frame.f_back else "")
        if not where.startswith(ROOT):
            return
        rel, name = where[len(ROOT):], code.co_name if event == "call" else ""
        if not stays or stays[-1][0] != rel:
            stays.append((rel, [name] if name else []))
        elif name and name not in stays[-1][1]:
            stays[-1][1].append(name)

    body = {"prompt": "a fox", "size": "64x64", "seconds": "1"}
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        with serve_in_process(tmp_path, WAN) as (client, _state, _files, _handler, _engine):
            first = client.post("/v1/videos", json=body)  # the first request pays one-time imports
            assert first.status_code == 200, first.text
            assert client.delete(f"/v1/videos/{first.json()['id']}").status_code == 200
            second = client.post("/v1/videos", json=body)
            assert second.status_code == 200, second.text
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return stays


def test_create_video_path_is_short_and_does_no_start_up_work(tmp_path) -> None:
    stays = trace_create_video(tmp_path)
    seen: set[str] = set()
    returns = 0
    lines = []
    for i, (rel, names) in enumerate(stays, 1):
        again = rel in seen
        returns += again
        seen.add(rel)
        lines.append(f"{i:3d} {'R' if again else ' '} {rel}: {', '.join(names)}")
    walk = "\n".join(lines)
    print(f"\n{walk}\nstays {len(stays)} in {len(seen)} files, returns {returns}")
    assert stays and stays[0][0] == "api/videos.py" and "create_video" in stays[0][1], walk
    assert not START_UP & {n for _, names in stays for n in names}, walk
    assert len(stays) <= MAX_STAYS and returns <= MAX_RETURNS, walk
