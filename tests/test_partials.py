"""Streamed image generations (issue 37 item 6): ``stream=true`` with ``partial_images`` sends OpenAI's
server-sent events, previews decoded from the worker's intermediate latents (``omni_ext.partials``, the
``partial-images`` patch), then the final image, the same bytes as without streaming.

The pure plan and the file hand-over are tested here without a server; the stream itself through the
openai SDK's streaming iterator against the real servers: the TunedExecutor's CFG pair and vLLM-Omni's
own executor on the same layout (the previews of both are the same bytes), and a single-process server.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import requests

from omni_ext import partials
from tests.conftest import TENANT_KEYS

FIELDS = {"negative_prompt": "blurry", "true_cfg_scale": 4.0, "num_inference_steps": 4, "seed": 7}


def test_partial_steps_are_evenly_spaced_and_never_the_last() -> None:
    assert partials.partial_steps(8, 3) == (2, 4, 6)
    assert partials.partial_steps(50, 2) == (17, 33)
    assert partials.partial_steps(4, 2) == (1, 3)
    assert partials.partial_steps(4, 1) == (2,)
    assert partials.partial_steps(2, 3) == (1,)  # fewer steps than previews: fewer previews (OpenAI: "at most")
    assert partials.partial_steps(1, 3) == partials.partial_steps(8, 0) == ()
    assert partials.partial_steps(8, 9) == partials.partial_steps(8, 3)  # bounded by OpenAI's 3
    for total in range(2, 60):
        for count in range(1, 4):
            steps = partials.partial_steps(total, count)
            assert steps == tuple(sorted(set(steps))) and all(1 <= s < total for s in steps)
            assert len(steps) == min(count, total - 1)


def test_what_a_request_asks_for() -> None:
    assert partials.wanted({partials.KEY: 2}) == 2
    assert partials.wanted({partials.KEY: 7}) == 3
    for bad in (None, {}, {partials.KEY: "2"}, {partials.KEY: True}, {partials.KEY: -1}, [partials.KEY]):
        assert partials.wanted(bad) == 0


def test_previews_go_from_worker_to_api_by_engine_request_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OMNI_EXT_PROGRESS_DIR", str(tmp_path))
    assert partials.write("img_gen-abc-1234abcd", 0, b"zero")
    assert partials.write("img_gen-abc-1234abcd", 1, b"one")
    assert partials.write("img_gen-abcd", 0, b"another request")
    assert not partials.write("../escape", 0, b"x") and not partials.write(".hidden", 0, b"x")
    seen: set[int] = set()
    assert partials.read_new("img_gen-abc", seen) == [(0, b"zero"), (1, b"one")]
    assert partials.read_new("img_gen-abc", seen) == [] and seen == {0, 1}
    partials.write("img_gen-abc-1234abcd", 2, b"two")
    assert partials.read_new("img_gen-abc", seen) == [(2, b"two")]
    partials.clear("img_gen-abc")
    assert sorted(p.name for p in (tmp_path / partials.DIR).iterdir()) == ["img_gen-abcd.0.png"]
    monkeypatch.delenv("OMNI_EXT_PROGRESS_DIR")
    assert not partials.write("img_gen-x", 0, b"x") and partials.read_new("img_gen-x", set()) == []


def _stream(server, key: str = "unused", **fields) -> list:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    return list(client.images.generate(prompt="a red fox in snow", size="64x64", stream=True,
                                       extra_body={**FIELDS, **fields.pop("extra", {})}, **fields))


def _png_size(b64: str) -> tuple[int, int]:
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64))).size


def test_streamed_generation_sends_partials_then_the_same_image(server_pool) -> None:
    import openai

    tuned, stock = server_pool.get("qwen-tuned-cfg2"), server_pool.get("qwen-cfg2")
    events = _stream(tuned, partial_images=2)
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert all(_png_size(e.b64_json) == (64, 64) and e.output_format == "png" and e.size == "64x64" for e in events)
    previews = [base64.b64decode(e.b64_json) for e in events]
    assert len(set(previews)) == 3  # after step 1, after step 3, the image
    client = openai.OpenAI(base_url=tuned.url + "/v1", api_key="unused", max_retries=0)
    plain = client.images.generate(prompt="a red fox in snow", size="64x64", extra_body=FIELDS)
    assert base64.b64decode(plain.data[0].b64_json) == previews[-1]  # streaming changes nothing of the image
    # vLLM-Omni's own executor on the same CFG-2 layout: the same previews and image
    assert [base64.b64decode(e.b64_json) for e in _stream(stock, key=TENANT_KEYS[0], partial_images=2)] == previews
    # no previews asked for: the completed event alone; a preview in the request's format
    assert [e.type for e in _stream(tuned)] == ["image_generation.completed"]
    jpeg = _stream(tuned, partial_images=1, output_format="jpeg")
    assert [e.type for e in jpeg] == ["image_generation.partial_image", "image_generation.completed"]
    assert base64.b64decode(jpeg[0].b64_json)[:3] == b"\xff\xd8\xff"


def test_a_stream_on_one_process_and_its_refusals(server_pool) -> None:
    """vLLM-Omni's executor on one process (rank 0 decodes), three previews of an 8-step image; what a
    stream cannot carry refused before it starts, in the JSON error shape."""
    server = server_pool.get("qwen")
    events = _stream(server, partial_images=3, extra={"num_inference_steps": 8})
    assert [getattr(e, "partial_image_index", None) for e in events] == [0, 1, 2, None]
    for body, param in (({"stream": True, "n": 2}, "n"), ({"stream": True, "response_format": "url"}, "response_format"),
                        ({"partial_images": 1}, "partial_images")):
        resp = requests.post(server.url + "/v1/images/generations", json={"prompt": "x", **body}, timeout=60)
        assert resp.status_code == 400 and resp.headers["content-type"].startswith("application/json"), resp.text
        assert resp.json()["error"]["param"] == param
    raw = requests.post(server.url + "/v1/images/generations", stream=True, timeout=120,
                        json={"prompt": "x", "size": "64x64", "stream": True, "partial_images": 1, **FIELDS})
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    text = raw.text
    assert text.startswith("event: image_generation.partial_image\ndata: {") and text.endswith("\n\n")


def test_a_model_without_previews_reports_the_field(tmp_path: Path) -> None:
    """A family without the previews hook reports ``partial_images`` as not applied (OpenAI promises at
    most that many) instead of refusing a client that always asks for them (pure intake)."""
    from omni_ext.api.intake import build_image_request
    from omni_ext.api.intake import ModelLimits
    from tests.helpers import api_state

    state = api_state(tmp_path, ModelLimits("FluxKontextPipeline", 16, 1, False))
    spec, reply = build_image_request({"prompt": "x", "stream": True, "partial_images": 2}, state)
    assert reply.stream and reply.partial_images == 0 and reply.ignored == ("partial_images",)
    assert partials.KEY not in (spec.request[1].extra_args or {})
    state = api_state(tmp_path, ModelLimits("QwenImagePipeline", 16, 1, False))
    spec, reply = build_image_request({"prompt": "x", "stream": True, "partial_images": 2}, state)
    assert reply.partial_images == 2 and spec.request[1].extra_args[partials.KEY] == 2


def test_a_client_that_leaves_mid_stream_frees_its_slot(server_pool) -> None:
    """The stream is closed after the first preview of a long image: the server counts the client gone,
    aborts the generation and serves the next request at once."""
    import time

    from tests.helpers import scrape

    server = server_pool.get("qwen")
    before = scrape(server, "omni_ext:requests_cancelled_total", reason="client_disconnected")
    body = {"prompt": "a long one", "size": "256x256", "stream": True, "partial_images": 3, **FIELDS,
            "num_inference_steps": 200}
    with requests.post(server.url + "/v1/images/generations", json=body, stream=True, timeout=120) as resp:
        assert resp.status_code == 200
        first = next(resp.iter_lines())
        assert first == b"event: image_generation.partial_image", first
    t0 = time.monotonic()
    while scrape(server, "omni_ext:requests_cancelled_total", reason="client_disconnected") < before + 1:
        assert time.monotonic() - t0 < 10, "the server did not notice the client leave"
        time.sleep(0.05)
    quick = requests.post(server.url + "/v1/images/generations", timeout=120,
                          json={"prompt": "x", "size": "64x64", **FIELDS})
    assert quick.status_code == 200 and time.monotonic() - t0 < 30, quick.text[:300]
    info = requests.get(server.url + "/v1/omni_ext/info", timeout=30).json()
    assert info["queue"]["running"] == 0 and info["queue"]["queued"] == 0, info["queue"]
