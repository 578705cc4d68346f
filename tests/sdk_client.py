"""Drive a server with the official ``openai`` SDK, as a user would; print one JSON report.

Run as a subprocess so the tests can use two SDK versions (the venv's current one, and 2.26 — the
last that sends ``videos.create`` as JSON — from ``.venv/openai-2.26`` on PYTHONPATH):

    python tests/sdk_client.py videos BASE_URL API_KEY
    python tests/sdk_client.py images BASE_URL API_KEY
"""

from __future__ import annotations

import io
import json
import sys
import time
import warnings

import httpx
import openai
from PIL import Image

warnings.simplefilter("ignore", DeprecationWarning)


class Recorder:
    """Records every HTTP request the SDK makes (method, path, content type, time)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    def __call__(self, request: httpx.Request) -> None:
        self.requests.append({"method": request.method, "path": request.url.path,
                              "content_type": request.headers.get("content-type", ""), "t": time.monotonic()})

    def response(self, response: httpx.Response) -> None:
        self.requests[-1]["poll_after_ms"] = response.headers.get("openai-poll-after-ms")


def client(base_url: str, api_key: str, rec: Recorder) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=300,
                         http_client=httpx.Client(event_hooks={"request": [rec], "response": [rec.response]}))


def videos(base_url: str, api_key: str) -> dict:
    rec = Recorder()
    c = client(base_url, api_key, rec)
    extra = {"num_inference_steps": 2, "negative_prompt": "blurry", "seed": 11, "extra_params": {"note": "sdk"}}
    created = c.videos.create(prompt="a paper boat on a pond", seconds="1", size="32x32", extra_body=extra)
    create_ct = rec.requests[-1]["content_type"].split(";")[0]
    n_before = len(rec.requests)
    polled = c.videos.create_and_poll(prompt="a kite over the sea", seconds="1", size="48x32", extra_body=extra)
    polls = [r for r in rec.requests[n_before:] if r["method"] == "GET"]
    # (seconds the SDK waited before the next poll, what the previous answer asked for)
    gaps = [(b["t"] - a["t"], int(a["poll_after_ms"] or 0) / 1000) for a, b in zip(polls, polls[1:])]
    first = c.videos.retrieve(created.id)
    for _ in range(600):
        if first.status in ("completed", "failed"):
            break
        time.sleep(0.1)
        first = c.videos.retrieve(created.id)
    page_ids = [v.id for v in c.videos.list(limit=1)]  # auto-paginates with after=last_id
    page1 = c.videos.list(limit=1, order="asc")
    video = c.videos.download_content(polled.id).read()
    thumb = c.videos.download_content(polled.id, variant="thumbnail").read()
    sheets = [c.videos.download_content(polled.id, variant="spritesheet").read() for _ in range(2)]  # made, then kept
    # a remix with the same prompt reruns the source's parameters and seed: the same bytes
    remix = c.videos.remix(polled.id, prompt="a kite over the sea")
    for _ in range(600):
        if remix.status in ("completed", "failed"):
            break
        time.sleep(0.1)
        remix = c.videos.retrieve(remix.id)
    remix_same = remix.status == "completed" and c.videos.download_content(remix.id).read() == video
    deleted = c.videos.delete(created.id)
    try:
        c.videos.retrieve(created.id)
        after_delete = "found"
    except openai.NotFoundError as exc:
        after_delete = f"404 {exc.body}"
    try:
        c.videos.create(prompt="x", size="30x30", seconds="1")
        bad = "accepted"
    except openai.BadRequestError as exc:
        bad = exc.body
    return {
        "sdk": openai.__version__, "create_content_type": create_ct, "created_status": created.status,
        "first": first.model_dump(), "polled": polled.model_dump(), "poll_count": len(polls), "poll_gaps": gaps,
        "listed_ids": page_ids, "page1_ids": [v.id for v in page1.data], "page1_has_more": page1.has_more,
        "video_head": video[4:8].decode("latin1"), "video_len": len(video),
        "thumb_head": thumb[:4].decode("latin1") + thumb[8:12].decode("latin1"),
        "sheet_size": list(Image.open(io.BytesIO(sheets[0])).size), "sheet_format": Image.open(io.BytesIO(sheets[0])).format,
        "sheet_kept": sheets[0] == sheets[1],
        "remix": remix.model_dump(), "remix_same_bytes": remix_same,
        "deleted": deleted.model_dump(), "after_delete": after_delete, "bad_request": bad,
    }


def images(base_url: str, api_key: str) -> dict:
    import base64

    rec = Recorder()
    c = client(base_url, api_key, rec)
    extra = {"num_inference_steps": 2, "seed": 3, "negative_prompt": "blurry", "true_cfg_scale": 4.0}
    b64 = c.images.generate(prompt="a red bicycle", size="32x32", n=2, response_format="b64_json", extra_body=extra)
    url = c.images.generate(prompt="a red bicycle", size="32x32", n=2, response_format="url", extra_body=extra)
    fetched = httpx.get(url.data[0].url, headers={"Authorization": f"Bearer {api_key}"}).content
    return {
        "sdk": openai.__version__,
        "b64_count": len(b64.data),
        "b64_pngs": [base64.b64decode(d.b64_json)[:8].hex() for d in b64.data],
        "b64_first": b64.data[0].b64_json,
        "url": url.data[0].url,
        "url_png": fetched[:8].hex(),
        "url_bytes_b64": base64.b64encode(fetched).decode(),
        "size": b64.size,
    }


if __name__ == "__main__":
    mode, base, key = sys.argv[1:4]
    print("REPORT " + json.dumps(videos(base, key) if mode == "videos" else images(base, key)))
