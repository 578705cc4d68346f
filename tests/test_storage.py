"""The result store stays bounded on a real server: finished jobs expire with their media after the
TTL, and a quota (``omni_ext.api.max_store_mb``) drops expired results first and answers 507
``storage_full`` before any work once live results fill it.

One server of its own (a TTL of seconds and a quota of a few tiny videos would disturb every other
test); the pure rules are in ``tests/test_api_units.py`` (``test_store_quota_*``, ``test_expiry_*``).
"""

from __future__ import annotations

import os
import time

import pytest
import requests

from omni_ext.server_process import ServeProcess
from tests.media import decode_mp4

TTL_S = 8
QUOTA_MB = 0.03  # ~31 KB: a handful of the 32x32, 5-frame videos below (mp4 + webp thumbnail each)
SMALL = {"prompt": "a kite over a beach", "size": "32x32", "num_frames": "5", "num_inference_steps": "2"}


def _create(server: ServeProcess, seed: int) -> requests.Response:
    return requests.post(server.url + "/v1/videos", files={k: (None, str(v)) for k, v in {**SMALL, "seed": seed}.items()},
                         timeout=60)


def _done(server: ServeProcess, video_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = requests.get(f"{server.url}/v1/videos/{video_id}", timeout=30).json()
        if body["status"] in ("completed", "failed"):
            return body
        time.sleep(0.1)
    raise AssertionError(f"{video_id} not done")


@pytest.mark.server
@pytest.mark.own_servers("wan2.1-t2v", {"store": ([], {"OMNI_EXT_API_TTL_S": str(TTL_S),
                                                       "OMNI_EXT_API_MAX_STORE_MB": str(QUOTA_MB)})})
def test_quota_refuses_before_work_and_expired_jobs_go_with_their_media(own: dict[str, ServeProcess]) -> None:
    server = own["store"]
    media_dir = server.env["OMNI_EXT_API_DATA_DIR"] + "/media"
    info = requests.get(server.url + "/v1/omni_ext/info", timeout=30).json()
    assert info["store"]["max_store_mb"] == QUOTA_MB and info["store"]["ttl_s"] == TTL_S
    done: list[dict] = []
    refused = None
    t0 = time.monotonic()
    for seed in range(40):
        resp = _create(server, seed)
        if resp.status_code != 200:
            refused = resp
            break
        body = _done(server, resp.json()["id"])
        assert body["status"] == "completed", body  # admission saw room for one more result: it was stored
        done.append(body)
    fill_s = time.monotonic() - t0
    assert refused is not None and done, "the quota never filled"
    err = refused.json()["error"]
    assert refused.status_code == 507 and err["code"] == "storage_full" and "max_store_mb" in err["message"], err
    assert err["type"] and set(err) == {"message", "type", "param", "code"}
    jobs_before = len(requests.get(server.url + "/v1/videos?limit=100", timeout=30).json()["data"])
    assert jobs_before == len(done)  # the refusal left no job behind
    for body in done:
        assert decode_mp4(requests.get(f"{server.url}/v1/videos/{body['id']}/content", timeout=30).content) == (5, 32, 32)
        assert body["expires_at"] == body["completed_at"] + TTL_S

    # Past the first job's expiry, a create makes room by dropping the expired jobs, oldest first, and is served.
    time.sleep(max(0.0, done[0]["expires_at"] + 1.5 - time.time()))
    resp = _create(server, 100)
    assert resp.status_code == 200, resp.text
    assert _done(server, resp.json()["id"])["status"] == "completed"
    first = requests.get(f"{server.url}/v1/videos/{done[0]['id']}", timeout=30)
    assert first.status_code == 404 and first.json()["error"]["code"] == "video_not_found"  # record and media gone
    listed = {v["id"] for v in requests.get(server.url + "/v1/videos?limit=100", timeout=30).json()["data"]}
    assert done[0]["id"] not in listed and resp.json()["id"] in listed
    # The sweeper removes every expired job by itself (period max(5 s, ttl/4)); no media file is left behind.
    deadline = time.monotonic() + TTL_S + 15
    while time.monotonic() < deadline and requests.get(server.url + "/v1/videos?limit=100", timeout=30).json()["data"]:
        time.sleep(0.5)
    assert requests.get(server.url + "/v1/videos?limit=100", timeout=30).json()["data"] == []
    assert os.listdir(media_dir) == []
    print(f"\n[storage] {len(done)} videos filled {QUOTA_MB} MB in {fill_s:.1f} s; the next create: 507 storage_full")
