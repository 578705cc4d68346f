"""omni-ext's OpenAI-compatible /v1/videos and /v1/images on real ``vllm-omni serve`` processes.

Clients are the official ``openai`` SDK (the current one, and 2.26 — the last that sends
``videos.create`` as JSON), vLLM-Omni-style curl calls (multipart), and raw HTTP for malformed input.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from omni_ext.api.intake import UPLOAD_FIELDS
from tests.media import decode_mp4, decode_png

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-omni-ext-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: openai-python releases beside the venv's current one (the newest 3.x): 2.26, the last that sends
#: ``videos.create`` as JSON, and 3.57; scripts/setup.sh installs each into ``.venv/openai-<version>``.
PINNED_SDKS = ("2.26", "3.57")
#: openai-node, the newest (scripts/setup.sh installs it into ``.venv/openai-node``).
NODE_SDK = ROOT / ".venv" / "openai-node"
TINY = {"prompt": "a lantern in the fog", "negative_prompt": "blurry", "num_inference_steps": 2, "seed": 9}


def run_sdk(mode: str, server, key: str, sdk: str = "current") -> dict:
    """``tests/sdk_client.py`` under openai-python ``sdk`` (``current``: the venv's; else a pinned one)."""
    env = {**os.environ}
    if sdk != "current":
        where = ROOT / ".venv" / f"openai-{sdk}"
        assert where.is_dir(), f"scripts/setup.sh installs openai {sdk} into {where}"
        env["PYTHONPATH"] = f"{where}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return _report([sys.executable, str(ROOT / "tests" / "sdk_client.py"), mode, server.url, key], env)


def run_node(mode: str, server, key: str) -> dict:
    """``tests/node_client.mjs`` under openai-node."""
    assert shutil.which("node") and (NODE_SDK / "node_modules" / "openai").is_dir(), \
        "scripts/setup.sh installs node and openai-node into .venv/openai-node"
    return _report(["node", str(ROOT / "tests" / "node_client.mjs"), mode, server.url, key],
                   {**os.environ, "OPENAI_NODE_DIR": str(NODE_SDK)})


def _report(cmd: list[str], env: dict[str, str]) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


def wait_done(server, video_id: str, headers=None, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = requests.get(f"{server.url}/v1/videos/{video_id}", headers=headers, timeout=30).json()
        if body["status"] in ("completed", "failed"):
            return body
        time.sleep(0.1)
    raise AssertionError(f"{video_id} not done after {timeout} s")


def assert_openai_error(resp: requests.Response, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    return err


# ---- SDKs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("sdk", ["current", *PINNED_SDKS], ids=lambda v: f"sdk-{v}")
def test_openai_sdk_videos(server_pool, sdk: str) -> None:
    r = run_sdk("videos", server_pool.get("wan-api"), KEY, sdk=sdk)
    if sdk == "2.26":
        assert r["sdk"] == "2.26.0" and r["create_content_type"] == "application/json"
    else:
        assert r["sdk"].startswith(f"{sdk}.") or sdk == "current", r["sdk"]
        assert int(r["sdk"].split(".")[0]) >= 3 and r["create_content_type"] == "multipart/form-data"
    assert r["created_status"] in ("queued", "in_progress")
    assert r["first"]["status"] == "completed" and r["first"]["progress"] == 100 and r["first"]["size"] == "32x32"
    assert r["first"]["seconds"] == "1" and r["first"]["num_frames"] == 17 and r["first"]["fps"] == 16  # Wan: 16 fps
    assert r["polled"]["status"] == "completed" and r["polled"]["size"] == "48x32"
    assert r["poll_count"] >= 1
    # create_and_poll takes its interval from the first in-progress answer's openai-poll-after-ms and
    # keeps it (openai-python reads the header once), so every wait is at least that first value
    if r["poll_gaps"]:
        first_asked = r["poll_gaps"][0][1]
        assert first_asked > 0 and all(waited >= first_asked * 0.9 for waited, _ in r["poll_gaps"]), r["poll_gaps"]
    assert r["first"]["id"] in r["listed_ids"] and r["polled"]["id"] in r["listed_ids"]
    assert len(r["page1_ids"]) == 1 and r["page1_has_more"] is True
    assert r["video_head"] == "ftyp" and r["video_len"] > 500
    assert r["thumb_head"] == "RIFFWEBP"
    # 17 frames of 48x32: 8 evenly spaced in two rows of 4, as one JPEG; the second download is the kept file
    remix = r["remix"]
    assert remix["remixed_from_video_id"] == r["polled"]["id"] and remix["size"] == "48x32", remix
    assert remix["status"] == "completed" and r["remix_same_bytes"], remix  # the source's parameters and seed
    assert r["sheet_format"] == "JPEG" and r["sheet_size"] == [4 * 48, 2 * 32] and r["sheet_kept"], r
    assert r["deleted"] == {"id": r["first"]["id"], "object": "video.deleted", "deleted": True}
    assert r["after_delete"].startswith("404")
    bad = r["bad_request"]
    assert "multiple of 16" in bad.get("error", bad)["message"]  # the SDK exposes the error object


@pytest.mark.parametrize("sdk", ["current", *PINNED_SDKS], ids=lambda v: f"sdk-{v}")
def test_openai_sdk_images(server_pool, sdk: str) -> None:
    r = run_sdk("images", server_pool.get("qwen"), "unused", sdk=sdk)
    assert sdk == "current" or r["sdk"].startswith(f"{sdk}."), r["sdk"]
    assert r["b64_count"] == 2 and all(h == "89504e470d0a1a0a" for h in r["b64_pngs"])
    assert r["size"] == "32x32"
    assert "/v1/images/img_" in r["url"] and r["url"].endswith("/content")
    assert r["url_png"] == "89504e470d0a1a0a"
    # Same seed, same request: the image behind the url is the first b64 image, byte for byte.
    assert base64.b64decode(r["url_bytes_b64"]) == base64.b64decode(r["b64_first"])
    assert decode_png(base64.b64decode(r["b64_first"])).shape[:2] == (32, 32)


def test_openai_node_sdk_videos_and_images(server_pool) -> None:
    """The newest openai-node against the same routes: a video created (its SDK always sends multipart),
    polled, listed, downloaded with each variant, remixed to the same bytes and deleted; an image as
    b64_json and as a url link, the same bytes for the same request and seed; errors the SDK turns into its own
    exception classes. Extension fields ride in the params object beside OpenAI's."""
    r = run_node("videos", server_pool.get("wan-api"), KEY)
    assert int(r["sdk"].split(".")[0]) >= 6, r["sdk"]
    done = r["done"]
    assert done["status"] == "completed" and done["size"] == "48x32" and done["seconds"] == "1", done
    assert done["id"] in r["listed_ids"]
    assert r["video_head"] == "ftyp" and r["video_len"] > 500 and r["thumb_head"] == "RIFFWEBP"
    assert r["sheet_head"] == "ffd8ff"  # a JPEG
    assert r["remix"]["remixed_from_video_id"] == done["id"] and r["remix_same_bytes"], r["remix"]
    assert r["deleted"]["deleted"] is True and r["after_delete"]["status"] == 404
    bad = r["bad_request"]
    assert bad["status"] == 400 and bad["name"] == "BadRequestError" and "multiple of 16" in bad["error"]["message"], bad
    img = run_node("images", server_pool.get("qwen"), "unused")
    assert img["b64_count"] == 2 and img["size"] == "32x32" and "/v1/images/img_" in img["url"]
    assert base64.b64decode(img["url_bytes_b64"]) == base64.b64decode(img["b64_first"])  # same seed, same bytes
    assert img["bad_request"]["status"] == 400 and img["bad_request"]["error"]["param"] == "quality", img["bad_request"]


# ---- vLLM-Omni-style clients ---------------------------------------------------------------------
def test_vllm_omni_curl_calls_unchanged(server_pool) -> None:
    server = server_pool.get("wan")
    form = {"prompt": (None, "a fox"), "size": (None, "32x32"), "num_frames": (None, "5"), "fps": (None, "8"),
            "num_inference_steps": (None, "2"), "seed": (None, "4"), "extra_params": (None, json.dumps({"k": 1}))}
    sync = requests.post(server.url + "/v1/videos/sync", files=form, timeout=300)
    assert sync.status_code == 200 and sync.headers["content-type"] == "video/mp4"
    assert {"x-request-id", "x-model", "x-inference-time-s", "x-stage-durations", "x-peak-memory-mb"} <= set(sync.headers)
    assert decode_mp4(sync.content) == (5, 32, 32)
    created = requests.post(server.url + "/v1/videos", files=form, timeout=60)
    assert created.status_code == 200, created.text
    job = wait_done(server, created.json()["id"])
    assert job["status"] == "completed"
    content = requests.get(f"{server.url}/v1/videos/{job['id']}/content", timeout=60)
    assert content.content == sync.content  # same seed, same request, same bytes as /sync


def test_json_create_rejected_by_stock_route(server_pool) -> None:
    """The bug behind the openai-routes patch: stock vLLM-Omni refuses JSON creates (SDKs before 2.27)."""
    body = {**TINY, "size": "32x32", "seconds": "1"}
    stock = requests.post(server_pool.get("wan-stock").url + "/v1/videos", json=body, timeout=60)
    assert 400 <= stock.status_code < 500
    ours = requests.post(server_pool.get("wan").url + "/v1/videos", json=body, timeout=60)
    assert ours.status_code == 200 and ours.json()["status"] in ("queued", "in_progress")


def _png(color: tuple[int, int, int], side: int = 16) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buf, format="PNG")
    return buf.getvalue()


def test_input_references_and_control_reference_get_vllm_omnis_answer(server_pool) -> None:
    """Issue 35, item 3: vLLM-Omni's own multipart ``input_references`` (several files) and ``control_reference``
    + ``control_type``, which omni-ext's /v1/videos used to refuse with a 400 vLLM-Omni does not give, get
    vLLM-Omni's own answer on omni-ext's routes. The tiny Wan takes no mixed references, so both routes hand
    the two PNGs to the pipeline as reference video files, and generate the same bytes for the same seed (sync
    and async); it declares no control upload type, so a control upload is the same 400 with the same message
    (an OpenAI-style error naming control_type), as is input_references beside input_reference. No reference
    file is left in the temporary directory."""
    import glob
    import tempfile

    ours, stock = server_pool.get("wan"), server_pool.get("wan-stock")
    pattern = os.path.join(tempfile.gettempdir(), "vllm_omni_*reference_*")
    before = set(glob.glob(pattern))
    form = [("prompt", (None, "a fox")), ("size", (None, "32x32")), ("num_frames", (None, "5")), ("fps", (None, "8")),
            ("num_inference_steps", (None, "2")), ("seed", (None, "4"))]
    refs = [("input_references", ("red.png", _png((200, 10, 10)), "image/png")),
            ("input_references", ("blue.png", _png((10, 10, 200)), "image/png"))]
    sync = {name: requests.post(server.url + "/v1/videos/sync", files=form + refs, timeout=300)
            for name, server in (("ours", ours), ("stock", stock))}
    for name, resp in sync.items():
        assert resp.status_code == 200 and resp.headers["content-type"] == "video/mp4", (name, resp.text[:1000])
        assert decode_mp4(resp.content) == (5, 32, 32), name
    assert sync["ours"].content == sync["stock"].content
    created = requests.post(ours.url + "/v1/videos", files=form + refs, timeout=60)
    assert created.status_code == 200, created.text
    job = wait_done(ours, created.json()["id"])
    assert job["status"] == "completed", job
    assert requests.get(f"{ours.url}/v1/videos/{job['id']}/content", timeout=60).content == sync["ours"].content

    control = [("control_type", (None, "edge")), ("control_reference", ("edge.png", _png((0, 0, 0)), "image/png"))]
    both_refs = refs + [("input_reference", ("c.png", _png((1, 2, 3)), "image/png"))]
    for extra, param, code in ((control, "control_type", "unsupported_parameter"),
                               (both_refs, "input_references", "invalid_value")):
        answers = {name: requests.post(server.url + "/v1/videos/sync", files=form + extra, timeout=60)
                   for name, server in (("ours", ours), ("stock", stock))}
        assert answers["stock"].status_code == 400, answers["stock"].text[:500]
        err = assert_openai_error(answers["ours"], 400)
        assert err["message"] == answers["stock"].json()["error"]["message"], (err, answers["stock"].text[:500])
        assert (err["param"], err["code"]) == (param, code)
        created = requests.post(ours.url + "/v1/videos", files=form + extra, timeout=60)  # refused before a job exists
        assert assert_openai_error(created, 400)["message"] == err["message"]
    assert not set(glob.glob(pattern)) - before  # every reference file removed once its request ended


def test_bracketed_multipart_fields(server_pool) -> None:
    server = server_pool.get("wan")
    form = [("prompt", (None, "x")), ("size", (None, "32x32")), ("seconds", (None, "1")),
            ("num_inference_steps", (None, "2")), ("extra_params[video_codec_options][preset]", (None, "ultrafast"))]
    resp = requests.post(server.url + "/v1/videos", files=form, timeout=60)
    assert resp.status_code == 200, resp.text
    assert wait_done(server, resp.json()["id"])["status"] == "completed"


# ---- progress ---------------------------------------------------------------------------------
def test_progress_moves_and_poll_header(server_pool) -> None:
    server = server_pool.get("wan", quiet=True)
    job = requests.post(server.url + "/v1/videos", json={**TINY, "size": "128x128", "num_frames": 9,
                                                           "num_inference_steps": 200}, timeout=60).json()
    seen, headers = [], []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        resp = requests.get(f"{server.url}/v1/videos/{job['id']}", timeout=30)
        body = resp.json()
        seen.append(body["progress"])
        if body["status"] in ("queued", "in_progress"):
            headers.append(int(resp.headers["openai-poll-after-ms"]))
        else:
            assert "openai-poll-after-ms" not in resp.headers
            break
        time.sleep(0.05)
    assert body["status"] == "completed" and seen[-1] == 100
    assert seen == sorted(seen), "progress went backwards"
    assert len({p for p in seen if 0 < p < 100}) >= 3, seen  # it moves, it does not jump 0 -> 100
    assert headers and all(100 <= h <= 5000 for h in headers)


def test_delete_cancels_running_job(server_pool) -> None:
    server = server_pool.get("wan")
    job = requests.post(server.url + "/v1/videos", json={**TINY, "size": "256x256", "num_frames": 17,
                                                           "num_inference_steps": 200}).json()
    for _ in range(600):
        if requests.get(f"{server.url}/v1/videos/{job['id']}").json()["status"] == "in_progress":
            break
        time.sleep(0.05)
    t0 = time.monotonic()
    resp = requests.delete(f"{server.url}/v1/videos/{job['id']}", timeout=60)
    assert resp.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert_openai_error(requests.get(f"{server.url}/v1/videos/{job['id']}"), 404)
    # the engine is free again quickly: a tiny request right after completes
    quick = requests.post(server.url + "/v1/videos/sync", json={**TINY, "size": "32x32", "num_frames": 5}, timeout=120)
    assert quick.status_code == 200
    assert time.monotonic() - t0 < 60


# ---- errors -----------------------------------------------------------------------------------
def test_api_key_enforced_with_openai_error(server_pool) -> None:
    server = server_pool.get("wan-api")
    calls = [("post", "/v1/videos"), ("post", "/v1/videos/sync"), ("get", "/v1/videos"), ("get", "/v1/videos/video_x"),
             ("get", "/v1/videos/video_x/content"), ("delete", "/v1/videos/video_x"),
             ("post", "/v1/images/generations"), ("get", "/v1/images/img_x/content"), ("post", "/v1/images/edits")]
    for method, path in calls:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            err = assert_openai_error(getattr(requests, method)(server.url + path, headers=headers, json=TINY), 401)
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert requests.get(server.url + "/v1/videos", headers=AUTH).status_code == 200


VIDEO_BAD_JSON = [
    ({"size": "32x32"}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "size": "16000x16000"}, 400, "size"),
    ({"prompt": "x", "size": "abc"}, 400, "size"),
    ({"prompt": "x", "seconds": "0"}, 400, "seconds"),
    ({"prompt": "x", "seconds": "abc"}, 400, "seconds"),
    ({"prompt": "x", "seconds": "-4"}, 400, "seconds"),
    ({"prompt": "x", "seconds": "1000"}, 400, "seconds"),
    ({"prompt": "x", "seconds": "61"}, 400, "seconds"),  # limits.MAX_SECONDS, as the schema's pattern says
    ({"prompt": "x", "fps": 241}, 400, "fps"),
    ({"prompt": "x", "seed": -1}, 400, "seed"),
    ({"prompt": "x", "num_inference_steps": "many"}, 400, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 201}, 400, "num_inference_steps"),
    ({"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"prompt": "x", "model": "sora-2"}, 404, "model"),
    ({"prompt": "x", "input_reference": {"image_url": "http://example.invalid/a.png"}}, 400, "input_reference"),
    ({"prompt": "x", "seconds": "1", "fps": {}}, 400, "fps"),
    ({"prompt": "x", "model": ["a"]}, 400, "model"),
    ({"prompt": "x", "num_outputs_per_prompt": 2}, 400, "num_outputs_per_prompt"),  # one job, one video
]


@pytest.mark.parametrize("body,status,needle", VIDEO_BAD_JSON, ids=[json.dumps(b)[:40] for b, _, _ in VIDEO_BAD_JSON])
def test_malformed_video_json(server_pool, body, status, needle) -> None:
    server = server_pool.get("wan")
    err = assert_openai_error(requests.post(server.url + "/v1/videos", json=body, timeout=60), status)
    assert needle in (err["message"] + str(err["param"]))


def _raw(server, data: bytes, ctype: str, path: str = "/v1/videos") -> requests.Response:
    return requests.post(server.url + path, data=data, headers={"Content-Type": ctype}, timeout=60)


def test_malformed_bodies_ids_and_queries(server_pool) -> None:
    server = server_pool.get("wan")
    cases = [
        (_raw(server, b"prompt=x", "text/plain"), 415),
        (_raw(server, b"{not json", "application/json"), 400),
        (_raw(server, b"[1, 2]", "application/json"), 400),
        (_raw(server, b"", "application/json"), 400),
        (_raw(server, b"--XX\r\nContent-Disposition: form-data; name=\"prompt\"\r\n\r\nfox", "multipart/form-data; boundary=XX"), 400),
        (_raw(server, b"garbage", "multipart/form-data"), 400),
        (requests.post(server.url + "/v1/videos", files={"prompt": (None, "x"), "input_reference": ("a.png", b"not an image", "image/png")}), 400),
        (requests.post(server.url + "/v1/videos", files={"prompt": (None, "x"), "weights": ("w.bin", b"\0" * 10)}), 400),
        (requests.get(server.url + "/v1/videos/video_doesnotexist"), 404),
        (requests.get(server.url + "/v1/videos/..%2F..%2Fetc%2Fpasswd"), 400),
        (requests.get(server.url + "/v1/videos/a%00b/content"), 400),
        (requests.delete(server.url + "/v1/videos/video_doesnotexist"), 404),
        (requests.get(server.url + "/v1/videos?limit=0"), 400),
        (requests.get(server.url + "/v1/videos?limit=101"), 400),
        (requests.get(server.url + "/v1/videos?limit=x"), 400),
        (requests.get(server.url + "/v1/videos?order=sideways"), 400),
        (requests.get(server.url + "/v1/videos?after=video_unknown"), 400),
        (requests.get(server.url + "/v1/images/img_doesnotexist/content"), 404),
        (requests.post(server.url + "/v1/images/edits", files={"prompt": (None, "x"), "image": ("a.png", b"x")}), 400),
    ]
    for i, (resp, status) in enumerate(cases):
        assert_openai_error(resp, status), i
    slow = requests.post(server.url + "/v1/videos", json={**TINY, "size": "128x128", "num_frames": 9,
                                                            "num_inference_steps": 200}).json()
    for variant, status, needle in (("video", 409, "completed"), ("bogus", 400, "'spritesheet'"),
                                    ("spritesheet", 409, "completed")):
        err = assert_openai_error(requests.get(f"{server.url}/v1/videos/{slow['id']}/content?variant={variant}"), status)
        assert needle in err["message"], err
    assert wait_done(server, slow["id"])["status"] == "completed"
    assert requests.post(server.url + "/v1/videos/sync", json={**TINY, "size": "32x32", "num_frames": 5}).status_code == 200


def test_oversized_upload_refused_before_it_is_read(server_pool) -> None:
    server = server_pool.get("wan")  # OMNI_EXT_API_MAX_UPLOAD_MB=2
    host, port = server.host, server.port
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=B\r\n"
                  b"Content-Length: 100000000\r\n\r\n--B\r\n")
        t0 = time.monotonic()
        reply = s.recv(4096)  # answered without the other ~100 MB ever being sent
    assert b" 413 " in reply.split(b"\r\n", 1)[0], reply[:200]
    assert time.monotonic() - t0 < 10
    big = requests.post(server.url + "/v1/videos", files={"prompt": (None, "x"), "input_reference": ("a.png", b"\0" * (3 * 2**20))})
    assert assert_openai_error(big, 413)["code"] == "request_too_large"


IMAGE_BAD = [
    ({"prompt": "x", "response_format": "xml"}, 400, "response_format"),
    ({"prompt": "x", "n": 11}, 400, "'n'"),
    ({"prompt": "x", "n": "two"}, 400, "'n'"),
    ({"prompt": "x", "output_format": "gif"}, 400, "output_format"),
    ({"prompt": "x", "size": "32x33"}, 400, "multiple of 16"),
    ({"prompt": "x", "num_inference_steps": 1}, 400, "num_inference_steps"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "partial_images": 2}, 400, "partial_images"),
    ({"prompt": "x", "stream": True, "n": 2}, 400, "'n'"),
    ({"prompt": "x", "stream": True, "response_format": "url"}, 400, "response_format"),
    ({"prompt": "x", "stream": True, "partial_images": 4}, 400, "partial_images"),
    ({"n": 1}, 400, "prompt"),
    ({"prompt": "x", "output_format": [None, None]}, 400, "output_format"),
    ({"prompt": "x", "negative_prompt": 3}, 400, "negative_prompt"),
]


@pytest.mark.parametrize("body,status,needle", IMAGE_BAD, ids=[json.dumps(b)[:40] for b, _, _ in IMAGE_BAD])
def test_malformed_image_requests(server_pool, body, status, needle) -> None:
    server = server_pool.get("qwen")
    err = assert_openai_error(requests.post(server.url + "/v1/images/generations", json=body, timeout=60), status)
    assert needle in (err["message"] + str(err["param"]))


def test_image_route_refuses_non_json_and_video_routes_on_image_model(server_pool) -> None:
    server = server_pool.get("qwen")
    assert_openai_error(_raw(server, b"prompt=x", "application/x-www-form-urlencoded", "/v1/images/generations"), 415)
    assert_openai_error(requests.post(server.url + "/v1/videos", json={"prompt": "x"}), 400)
    edit = requests.post(server.url + "/v1/images/edits", files={"prompt": (None, "x"), "image": ("a.png", b"x")})
    assert assert_openai_error(edit, 400)["code"] == "unsupported_model"


def test_schemathesis_finds_no_server_errors(server_pool, tmp_path) -> None:
    """Property-based fuzzing of omni-ext's routes from the server's own OpenAPI schema.

    GET/DELETE operations are fuzzed in every mode; POST bodies only with invalid data (negative
    mode), so no case starts a long generation on this CPU. The check: never a 5xx."""
    server = server_pool.get("wan")
    spec = requests.get(server.url + "/openapi.json", timeout=300).json()
    spec["paths"] = {p: v for p, v in spec["paths"].items() if p.startswith(("/v1/videos", "/v1/images"))}
    spec["servers"] = [{"url": server.url}]
    # The upload fields beside input_reference (intake.UPLOAD_FIELDS) are files: in a multipart body a negated
    # one (a single file for the input_references array) is still a file, which vLLM-Omni's route, and so
    # omni-ext's, carries to a text-only model that ignores it: a full default-size generation on this CPU.
    for op in spec["paths"].values():
        for method in op.values():
            for media in ((method.get("requestBody") or {}).get("content") or {}).values():
                props = (media.get("schema") or {}).get("properties") or {}
                for name in UPLOAD_FIELDS:
                    props.pop(name, None)
    spec_file = tmp_path / "openapi.json"
    spec_file.write_text(json.dumps(spec))
    exe = Path(sys.executable).with_name("schemathesis")
    common = [str(exe), "run", str(spec_file), "--url", server.url, "--checks", "not_a_server_error",
              "--max-examples", "25", "--request-timeout", "120", "--generation-deterministic", "--workers", "1",
              "--phases", "examples,coverage,fuzzing"]
    runs = [
        common + ["--include-method-regex", "GET|DELETE"],
        common + ["--include-method", "POST", "--mode", "negative"],
    ]
    for cmd in runs:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-6000:]
        assert "No issues found" in out or "passed" in out, out[-3000:]
    assert requests.post(server.url + "/v1/videos/sync", json={**TINY, "size": "32x32", "num_frames": 5}).status_code == 200


def test_a_prompt_over_the_token_bound_is_refused_before_any_work(server_pool) -> None:
    """On the real servers (tiny Wan: a T5 tokenizer; tiny Qwen-Image: a byte-level BPE one) a prompt of
    MAX_PROMPT_TOKENS + 1 tokens, well within the character bound, is a 400 naming the field and its
    token count on videos and images; ``/v1/omni_ext/info`` lists the bound."""
    from omni_ext.api.limits import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS

    over = " ".join(["cat"] * (MAX_PROMPT_TOKENS + 1))
    assert len(over) < MAX_PROMPT_CHARS
    for name, path in (("wan", "/v1/videos"), ("qwen", "/v1/images/generations")):
        server = server_pool.get(name)
        info = requests.get(server.url + "/v1/omni_ext/info", timeout=30).json()
        assert info["limits"]["max_prompt_tokens"] == MAX_PROMPT_TOKENS, info["limits"]
        before = requests.get(server.url + "/v1/videos?limit=100", timeout=30).json()["data"] if name == "wan" else []
        err = assert_openai_error(requests.post(server.url + path, json={"prompt": "ok", "negative_prompt": over},
                                                timeout=30), 400)
        assert err["param"] == "negative_prompt" and f"is {MAX_PROMPT_TOKENS + 1} tokens" in err["message"], err
        if name == "wan":  # no job was made of it
            assert requests.get(server.url + "/v1/videos?limit=100", timeout=30).json()["data"] == before


def test_every_served_model_name_is_accepted_in_model(server_pool) -> None:
    """The keyed server runs with ``--served-model-name wan2.1 sora-2``: ``/v1/models`` lists both, a
    create naming OpenAI's ``sora-2`` (as OpenAI's samples do) is the served model, another name is a 404."""
    from tests.helpers import auth

    server = server_pool.get("wan-api")
    names = [m["id"] for m in requests.get(server.url + "/v1/models", headers=auth(server), timeout=30).json()["data"]]
    assert names[:2] == ["wan2.1", "sora-2"], names
    for model in ("sora-2", "wan2.1"):
        resp = requests.post(server.url + "/v1/videos", headers=auth(server), timeout=60,
                             json={"prompt": "a kite", "model": model, "size": "32x32", "seconds": "1",
                                   "num_inference_steps": 2})
        assert resp.status_code == 200 and resp.json()["model"] == "wan2.1", resp.text
        requests.delete(f"{server.url}/v1/videos/{resp.json()['id']}", headers=auth(server), timeout=60)
    err = assert_openai_error(requests.post(server.url + "/v1/videos", headers=auth(server), timeout=60,
                                            json={"prompt": "a kite", "model": "sora-2-pro"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model", err


def test_the_sdk_sends_a_generation_the_model_refuses_once(server_pool) -> None:
    """The openai SDK retries 408, 409, 429 and every 5xx twice unless the server says otherwise. A
    prompt within omni-ext's bounds that the model itself refuses at run time (tiny Qwen-Image: more
    than its 1024 template tokens) fails the same way every time: the answer carries
    ``x-should-retry: false`` and the SDK's real retry loop sends it exactly once."""
    import httpx
    import openai

    server = server_pool.get("qwen")
    sent: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(r.url.path)]})
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=2, http_client=http)
    with pytest.raises(openai.APIStatusError) as err:
        client.images.generate(prompt=" ".join(["cat"] * 1500), size="32x32", extra_body={"num_inference_steps": 2})
    assert err.value.response.headers["x-should-retry"] == "false"
    assert sent == ["/v1/images/generations"], sent


def test_openai_image_hints_through_the_sdk(server_pool) -> None:
    """openai SDK on tiny Qwen-Image: ``quality="low"`` runs a quarter of the native steps (12 of 50: the
    vLLM-Omni's stats table says so), ``style`` and ``moderation`` come back in ``x-omni-ext-ignored-fields``,
    ``safety_identifier`` is accepted (and logged), ``background="transparent"`` is a 400 naming it."""
    import openai

    server = server_pool.get("qwen")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    raw = client.images.with_raw_response.generate(prompt="a red bicycle", size="32x32", quality="low", style="vivid",
                                                   moderation="low", safety_identifier="user-42")
    assert raw.headers["x-omni-ext-ignored-fields"] == "style,moderation"
    assert raw.parse().data[0].b64_json
    log = server.log_text()
    assert "for end user 'user-42'; accepted as hints and not applied: style, moderation" in log
    import re

    assert re.search(r"\| num_inference_steps\s*\|\s*12\.000 \|", log), "quality=low did not run 12 steps"  # vLLM-Omni's stats
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="a red bicycle", size="32x32", background="transparent")
    assert err.value.body["param"] == "background" and err.value.response.headers["x-should-retry"] == "false"


def test_image_variations_answer_a_clear_400_naming_the_alternative(server_pool) -> None:
    """``images.create_variation`` (no prompt) is not something a served diffusion model does: a 400 that
    names ``/v1/images/edits``, not vLLM's "No route"; the SDK does not retry it."""
    import openai

    server = server_pool.get("qwen")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.images.create_variation(image=("a.png", _png((200, 40, 40), 32), "image/png"))
    assert "/v1/images/edits" in err.value.message and err.value.code == "unsupported_endpoint", err.value.message
    assert err.value.response.headers["x-should-retry"] == "false"


def test_url_links_use_the_configured_public_url(server_pool) -> None:
    """Behind a proxy the address a request came to is not the clients': with ``public_url`` (this server:
    ``http://localhost:<port>``, its own address under another name) a ``url`` image link is built on it,
    and works; ``/v1/omni_ext/info`` says it."""
    server = server_pool.get("qwen-tuned-cfg2")
    public = f"http://localhost:{server.port}"
    assert requests.get(server.url + "/v1/omni_ext/info", timeout=30).json()["public_url"] == public
    resp = requests.post(server.url + "/v1/images/generations", timeout=300,
                         json={"prompt": "a red bicycle", "size": "32x32", "response_format": "url",
                               "num_inference_steps": 2})
    assert resp.status_code == 200, resp.text
    url = resp.json()["data"][0]["url"]
    assert url.startswith(public + "/v1/images/img_") and url.endswith("/content"), url
    image = requests.get(url, timeout=30)
    assert image.status_code == 200 and image.content[:8] == bytes.fromhex("89504e470d0a1a0a")
