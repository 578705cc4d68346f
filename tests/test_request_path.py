"""The path of a ``POST /v1/videos`` through omni-ext's modules, traced (issue 16, item 3).

Every omni_ext function the route enters is recorded in order with ``sys.setprofile`` on a real
request to omni-ext's router (``serve_in_process``: the app without an engine), and the path is
counted the way a reader follows it: a *stay* is each time the path enters a file (consecutive
calls inside one file are one stay), a *return* is a stay in a file the path had already left.

Two counts of the same trace:

- **as read**: what a reader follows from the route, function by function: lambdas,
  comprehensions, property getters and the bodies of context managers and generators (the route
  reads ``with storage(...)``) are not entered. The issue's target is at most 20 stays and 8 returns.
- **every call**: stricter, with those included; its bound is today's figure, so that any
  regression fails.

No start-up work runs on the request path.
"""

from __future__ import annotations

import inspect
import sys
import threading
from pathlib import Path

import omni_ext
from omni_ext.api.intake import ModelLimits
from tests.helpers import serve_in_process

ROOT = str(Path(omni_ext.__file__).parent) + "/"
WAN = ModelLimits("WanPipeline", 16, 1, True)
#: Functions that build state at start-up; none may run while a request is served.
START_UP = {"init_state", "request_queue", "load_settings", "limits_for_model", "resolve_video_backend",
            "configured_defaults", "native_video_defaults", "server_layout", "scheduler_config"}
#: (stays, returns): as read (the issue's target), and every call (today's figures).
AS_READ, EVERY_CALL = (20, 8), (23, 12)
Stays = list[tuple[str, list[str]]]


def _property_getters() -> set:
    """The code objects of every omni_ext property getter (a reader reads them as attributes)."""
    codes = set()
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("omni_ext"):
            for obj in vars(module).values():
                if isinstance(obj, type):
                    codes |= {v.fget.__code__ for v in vars(obj).values() if isinstance(v, property) and v.fget}
    return codes


def _as_read(frame, getters: set) -> bool:
    code = frame.f_code
    if code.co_name.startswith("<") or code in getters:
        return False
    return not (code.co_flags & inspect.CO_GENERATOR and frame.f_lasti > 0)  # a generator resumed


def trace_create_video(tmp_path: Path) -> tuple[Stays, Stays]:
    """(file under omni_ext/, functions entered there) per stay, as read and for every call, for the
    second create of a server (the first pays one-time imports)."""
    every: Stays = []
    read: Stays = []
    state = {"on": False, "armed": False, "thread": None}
    getters: set = set()

    def add(stays: Stays, rel: str, name: str) -> None:
        if not stays or stays[-1][0] != rel:
            stays.append((rel, [name] if name else []))
        elif name and name not in stays[-1][1]:
            stays[-1][1].append(name)

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        code = frame.f_code
        ours = code.co_filename.startswith(ROOT)
        if ours and code.co_name == "create_video" and state["armed"]:
            state["on"] = event == "call"
            state["thread"] = threading.get_ident()
        # only the route's own thread: the threads of other tests' executors (a deadline re-check
        # timer) and the app's pool run on while the route runs, and are no part of its path
        if not state["on"] or threading.get_ident() != state["thread"]:
            return
        where = code.co_filename if event == "call" else (frame.f_back.f_code.co_filename if frame.f_back else "")
        if not where.startswith(ROOT):
            return
        rel, name = where[len(ROOT):], code.co_name if event == "call" else ""
        add(every, rel, name)
        if _as_read(frame, getters):
            add(read, rel, name)

    body = {"prompt": "a fox", "size": "64x64", "seconds": "1"}
    threading.setprofile(profile)  # before the app's threads start
    sys.setprofile(profile)
    try:
        with serve_in_process(tmp_path, WAN) as (client, _state, _files, _handler, _engine):
            first = client.post("/v1/videos", json=body)
            assert first.status_code == 200, first.text
            assert client.delete(f"/v1/videos/{first.json()['id']}").status_code == 200
            getters.update(_property_getters())
            state["armed"] = True
            second = client.post("/v1/videos", json=body)
            state["armed"] = False
            assert second.status_code == 200, second.text
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return read, every


def _walk(stays: Stays) -> tuple[str, int]:
    seen: set[str] = set()
    returns = 0
    lines = []
    for i, (rel, names) in enumerate(stays, 1):
        again = rel in seen
        returns += again
        seen.add(rel)
        lines.append(f"{i:3d} {'R' if again else ' '} {rel}: {', '.join(names)}")
    return "\n".join(lines) + f"\nstays {len(stays)} in {len(seen)} files, returns {returns}", returns


def test_create_video_path_is_short_and_does_no_start_up_work(tmp_path) -> None:
    read, every = trace_create_video(tmp_path)
    for label, stays, (max_stays, max_returns) in (("as read", read, AS_READ), ("every call", every, EVERY_CALL)):
        walk, returns = _walk(stays)
        print(f"\n[{label}]\n{walk}")
        assert stays and stays[0][0] == "api/videos.py" and "create_video" in stays[0][1], walk
        assert not START_UP & {n for _, names in stays for n in names}, walk
        assert len(stays) <= max_stays and returns <= max_returns, f"{label}:\n{walk}"
