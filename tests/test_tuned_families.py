"""The tuned path of the models people run after Wan T2V and Qwen-Image (issue 35, item 4), on the real
serving path: image-to-video (``wan2.2-i2v``: Wan2.2-I2V-A14B's layout, two experts and the image as VAE
latents; ``wan2.2-ti2v``: TI2V-5B's ``WanPipeline`` with ``expand_timesteps`` and the Wan2.2 VAE, given an
image) and image editing (``qwen-image-edit``, ``qwen-image-edit-plus``: the Qwen2.5-VL encoder reads the
prompt with the reference image, whose VAE latents join the denoised sequence).

Each tiny model is served twice with ``--cfg-parallel-size 2``: by vLLM-Omni's own executor and by the
TunedExecutor, which splits the guidance branches' text encoding between the two CFG ranks and
pipelines the VAE decode (``omni_ext.executor.pipelines``). The same request and seed must give the
same bytes on both, for a CFG pair job, a request without CFG, and two requests at once.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.helpers import FLOAT32, float32_models, serve_models

TUNED = "omni_ext.executor.TunedExecutor"
CFG2 = ["--cfg-parallel-size", "2", *FLOAT32]
VIDEO_MODELS = ("wan2.2-i2v", "wan2.2-ti2v")
EDIT_MODELS = ("qwen-image-edit", "qwen-image-edit-plus")
MODELS = VIDEO_MODELS + EDIT_MODELS
VIDEO = {"prompt": "a paper boat drifting down a rain gutter", "negative_prompt": "blurry, static",
         "size": "64x64", "num_frames": 9, "num_inference_steps": 4, "seed": 7}


def _png(seed: int = 0, side: int = 64) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((side, side, 3)) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class _Groups:
    """The stock and tuned servers of one group of models (the videos, then the edits), one group up at a
    time: eight two-worker servers at once would crowd the shared servers of the session."""

    def __init__(self, models: dict[str, Path], root: Path) -> None:
        self.models, self.root, self.current, self.stack = models, root, None, contextlib.ExitStack()
        self.procs: dict[str, Any] = {}  # every server started so far (their logs outlive them)

    def __getitem__(self, name: str) -> Any:
        model = name.rsplit("-", 1)[0]
        group = VIDEO_MODELS if model in VIDEO_MODELS else EDIT_MODELS
        if group != self.current:
            self.stack.close()
            self.stack = contextlib.ExitStack()
            specs = {}
            for m in group:
                specs[f"{m}-stock"] = (str(self.models[m]), CFG2, {})
                specs[f"{m}-tuned"] = (str(self.models[m]), [*CFG2, "--distributed-executor-backend", TUNED], {})
            self.procs.update(self.stack.enter_context(serve_models(self.root / group[0], specs)))
            self.current = group
        return self.procs[name]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    groups = _Groups(float32_models(MODELS, tmp_path_factory.mktemp("models32")), tmp_path_factory.mktemp("tuned-families"))
    try:
        yield groups
    finally:
        groups.stack.close()


def _video(server, image_seed: int = 0, **fields) -> bytes:
    form = {k: (None, str(v)) for k, v in {**VIDEO, **fields}.items()}
    resp = requests.post(server.url + "/v1/videos/sync", files={**form, "input_reference": ("ref.png", _png(image_seed), "image/png")},
                         timeout=300)
    assert resp.status_code == 200 and resp.headers["content-type"] == "video/mp4", resp.text[:1000]
    return resp.content


@pytest.mark.server
@pytest.mark.parametrize("model", VIDEO_MODELS)
def test_tuned_image_to_video_gives_vllm_omnis_bytes(servers, model: str) -> None:
    stock, tuned = servers[f"{model}-stock"], servers[f"{model}-tuned"]
    info = requests.get(tuned.url + "/v1/omni_ext/info", timeout=30).json()
    assert info["layout"]["executor"] == "TunedExecutor", info["layout"]
    pair = _video(tuned)
    assert pair == _video(stock)
    assert _video(tuned, image_seed=1) != pair  # the image conditions the video
    # Guidance off: one rank runs the request alone (no CFG pair), still vLLM-Omni's bytes.
    off = {"guidance_scale": 1.0, "guidance_scale_2": 1.0} if model == "wan2.2-i2v" else {"guidance_scale": 1.0}
    assert _video(tuned, **off) == _video(stock, **off)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda seed: _video(tuned, seed=seed), (21, 22)))
    assert runs == [_video(stock, seed=21), _video(stock, seed=22)]


EDIT = {"prompt": "make the sky stormy", "negative_prompt": "blurry", "size": "64x64", "num_inference_steps": 4,
        "true_cfg_scale": 4.0, "seed": 7, "response_format": "b64_json"}


def _edit(server, image_seed: int = 0, **fields) -> bytes:
    form = {k: (None, str(v)) for k, v in {**EDIT, **fields}.items() if v is not None}
    resp = requests.post(server.url + "/v1/images/edits", files={**form, "image": ("ref.png", _png(image_seed), "image/png")},
                         timeout=300)
    assert resp.status_code == 200, resp.text[:1000]
    return base64.b64decode(resp.json()["data"][0]["b64_json"])


@pytest.mark.server
@pytest.mark.parametrize("model", EDIT_MODELS)
def test_tuned_image_edit_gives_vllm_omnis_bytes(servers, model: str) -> None:
    stock, tuned = servers[f"{model}-stock"], servers[f"{model}-tuned"]
    pair = _edit(tuned)
    assert pair == _edit(stock)
    assert _edit(tuned, image_seed=1) != pair  # the reference image conditions the edit
    # No negative prompt: no CFG pair (Qwen-Image's rule), one rank runs it alone.
    assert _edit(tuned, negative_prompt=None) == _edit(stock, negative_prompt=None)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda seed: _edit(tuned, seed=seed), (21, 22)))
    assert runs == [_edit(stock, seed=21), _edit(stock, seed=22)]


@pytest.mark.server
def test_edits_go_through_omni_exts_intake_and_answer_like_generations(servers) -> None:
    """``client.images.edit`` on an edit model, through omni-ext's intake around vLLM-Omni's edit endpoint:
    the same bytes as the form post to the stock-executor server, as b64_json and behind a ``url`` link; an
    OpenAI hint reported in the ignored-fields header; a wrong model, an unknown field and a missing image
    refused in the generations' error shape (404 / 400 naming the field), the SDK not retrying them."""
    import openai

    server = servers["qwen-image-edit-tuned"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    extra = {k: EDIT[k] for k in ("negative_prompt", "num_inference_steps", "true_cfg_scale", "seed")}
    ref = ("ref.png", _png(), "image/png")
    expected = _edit(servers["qwen-image-edit-stock"])
    b64 = client.images.edit(image=ref, prompt=EDIT["prompt"], size="64x64", response_format="b64_json",
                             extra_body=extra)
    assert base64.b64decode(b64.data[0].b64_json) == expected and b64.size == "64x64"
    raw = client.images.with_raw_response.edit(image=ref, prompt=EDIT["prompt"], size="64x64", response_format="url",
                                               input_fidelity="high", extra_body=extra)
    assert raw.headers.get("x-omni-ext-ignored-fields") == "input_fidelity"
    link = raw.parse().data[0].url
    assert "/v1/images/img_" in link and requests.get(link, timeout=60).content == expected
    with pytest.raises(openai.NotFoundError) as err:
        client.images.edit(image=ref, prompt="x", model="dall-e-2")
    assert err.value.code == "model_not_found"
    form = {k: (None, str(v)) for k, v in EDIT.items()}
    for files, param in (({**form, "colour": (None, "red"), "image": ref}, "colour"), (form, "image")):
        resp = requests.post(server.url + "/v1/images/edits", files=files, timeout=60)
        assert resp.status_code == 400 and resp.headers.get("x-should-retry") == "false", resp.text[:500]
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"} and resp.json()["error"]["param"] == param


@pytest.mark.server
def test_an_over_long_negative_prompt_fails_on_both_split_ranks_and_the_group_serves_on(servers) -> None:
    """Rank 1 of a split pair encodes the negative prompt alone; rank 0 must refuse it too (vLLM-Omni's
    token bound, checked on the tokenizer), else it would wait for rank 1 in the first all-gather."""
    tuned = servers["qwen-image-edit-tuned"]
    form = {k: (None, str(v)) for k, v in {**EDIT, "negative_prompt": " ".join(["blurry"] * 1500)}.items()}
    started = time.monotonic()
    resp = requests.post(tuned.url + "/v1/images/edits", files={**form, "image": ("ref.png", _png(), "image/png")}, timeout=120)
    assert resp.status_code >= 400 and "negative_prompt" in resp.text, resp.text[:1000]
    assert time.monotonic() - started < 60
    assert _edit(tuned) == _edit(servers["qwen-image-edit-stock"])  # the same group serves the next one


@pytest.mark.server
def test_the_tuned_split_ran(servers) -> None:
    """The TunedExecutor's CFG ranks each encoded one branch's text (logged once per worker)."""
    for model in MODELS:
        if f"{model}-tuned" not in servers.procs:
            servers[f"{model}-tuned"]
        log = Path(servers.procs[f"{model}-tuned"].log_path).read_text(errors="replace")
        assert "CFG rank 0 encodes only the prompt" in log and "CFG rank 1 encodes only the negative prompt" in log, model


def test_models_table_names_the_tuned_image_to_video_class() -> None:
    from omni_ext.models.decisions import decide, family_for
    from omni_ext.models.registry import facts_of

    facts = facts_of("WanImageToVideoPipeline")
    decision = decide(facts, family_for(facts))
    assert decision.path == "tuned" and decision.cfg_rule == "wan", decision
    assert json.loads(json.dumps(decision.inputs)) == ["image"]


@pytest.mark.server
def test_streamed_edit_sends_partials_then_the_same_image(servers) -> None:
    """``client.images.edit(stream=True, partial_images=2)`` on the edit models: OpenAI's ``image_edit.*``
    events, two previews from the worker that holds the latents, then the edit itself with the bytes of a
    request that does not stream; vLLM-Omni's executor and the TunedExecutor give the same previews."""
    import openai

    extra = {k: EDIT[k] for k in ("negative_prompt", "num_inference_steps", "true_cfg_scale", "seed")}

    def streamed(server) -> list:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        return list(client.images.edit(image=("ref.png", _png(), "image/png"), prompt=EDIT["prompt"], size="64x64",
                                       stream=True, partial_images=2, extra_body=extra))

    events = streamed(servers["qwen-image-edit-tuned"])
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"], events
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    images = [base64.b64decode(e.b64_json) for e in events]
    assert len(set(images)) == 3 and images[-1] == _edit(servers["qwen-image-edit-tuned"])
    assert [base64.b64decode(e.b64_json) for e in streamed(servers["qwen-image-edit-stock"])] == images
    # a JSON edit answers vLLM-Omni's metrics on, as its endpoint gives them
    form = {k: (None, str(v)) for k, v in EDIT.items()}
    answer = requests.post(servers["qwen-image-edit-tuned"].url + "/v1/images/edits", timeout=300,
                           files={**form, "image": ("ref.png", _png(), "image/png")}).json()
    assert answer["metrics"]["stage_durations"] and "peak_memory_mb" in answer["metrics"], answer.get("metrics")
