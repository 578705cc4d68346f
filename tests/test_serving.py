"""The real ``vllm-omni serve --omni`` with omni-ext installed, on tiny Wan2.1 and Qwen-Image models.

Every test talks HTTP to a real server process (see conftest.SERVERS): one worker, CFG parallel
over two worker processes (vLLM-Omni's executor and omni-ext's TunedExecutor), and the CPU
platform underneath.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import requests

from omni_ext.server_process import vllm_omni_exe
from tests.helpers import IMAGE, events_mark, image_gen, png_from, video_sync, wait_for_events
from tests.media import decode_mp4, decode_png


@pytest.mark.parametrize("server", ["wan"], indirect=True)
def test_video_sync_decodes_to_requested_frames_and_size(server) -> None:
    resp = video_sync(server, size="48x32", num_frames=9)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("video/mp4")
    assert decode_mp4(resp.content) == (9, 48, 32)


def assert_tuned_pair_run(server, before: float, *log_lines: str) -> None:
    """The one request sent since event ``before`` ran as a CFG pair on ranks 0 and 1, each rank
    encoding only its own prompt (omni-ext's TunedExecutor)."""
    ev = wait_for_events(server, before, 1)
    assert [e[2:] for e in ev if e[0] == "start"] == [((0, 1), "pair")]
    log = server.log_text()
    for line in log_lines:
        assert line in log
    assert "CFG rank 0 encodes only the prompt" in log and "CFG rank 1 encodes only the negative prompt" in log


# CFG parallel 2 with vLLM-Omni's executor and with omni-ext's TunedExecutor, each against the
# one-worker server. Tuned: 9 frames -> 3 latent frames, so its VAE decode really runs as the
# two-rank pipeline.
@pytest.mark.parametrize(
    "name,size,frames,tuned",
    [("wan-cfg2", "32x32", 5, False), ("wan-tuned-cfg2", "48x32", 9, True)],
    ids=["stock", "tuned"],
)
def test_cfg_parallel_2_video_is_byte_identical_to_one_worker(server_pool, name, size, frames, tuned) -> None:
    one, two = server_pool.get("wan"), server_pool.get(name)
    before = events_mark(two)
    a = video_sync(one, size=size, num_frames=frames)
    b = video_sync(two, size=size, num_frames=frames)
    assert a.status_code == b.status_code == 200, (a.text[:300], b.text[:300])
    width, height = (int(x) for x in size.split("x"))
    assert decode_mp4(b.content) == (frames, width, height)
    assert a.content == b.content
    if tuned:
        assert_tuned_pair_run(two, before, "Wan VAE decode split between CFG ranks")


@pytest.mark.parametrize("server", ["qwen"], indirect=True)
def test_image_generation_png_of_requested_size_in_default_dtype(server) -> None:
    assert "--dtype" not in server.args
    img = decode_png(png_from(image_gen(server, size="48x32")))
    assert img.shape[:2] == (32, 48)
    assert img.std() > 0  # real pixels, not a blank canvas
    assert "dtype=torch.bfloat16" in server.log_text()  # vLLM-Omni's default dtype, as served


@pytest.mark.parametrize(
    "name,size,tuned", [("qwen-cfg2", "32x32", False), ("qwen-tuned-cfg2", "48x32", True)], ids=["stock", "tuned"]
)
def test_cfg_parallel_2_image_is_identical_to_one_worker(server_pool, name, size, tuned) -> None:
    one, two = server_pool.get("qwen"), server_pool.get(name)
    before = events_mark(two)
    a = png_from(image_gen(one, size=size))
    b = png_from(image_gen(two, size=size))
    assert a == b
    if tuned:
        assert_tuned_pair_run(two, before)


@pytest.mark.parametrize("name,workers", [("wan", ["MainProcess"]), ("wan-cfg2", ["MainProcess", "DiffusionWorker-0", "DiffusionWorker-1"])])
def test_plugin_is_loaded_in_api_process_and_every_worker(server_pool, name, workers) -> None:
    log = server_pool.get(name).log_text()
    for proc in workers:
        assert f"loaded in {proc} (pid" in log, f"no omni-ext load line for {proc}"
    assert "cpu-platform=on" in log
    assert "OmniPlatform plugin omni_ext_cpu is activated" in log
    if name == "wan-cfg2":
        cores = len(os.sched_getaffinity(0))
        per = max(1, cores // 2)
        assert f"CPU worker rank 0/2 uses {per} thread(s)" in log
        assert f"CPU worker rank 1/2 uses {per} thread(s)" in log


BAD_VIDEO = [
    ({"size": "30x30"}, "multiple of 16"),
    ({"size": "32x33"}, "multiple of 16"),
    ({"width": "40", "height": "32"}, "multiple of 16"),
    ({"num_inference_steps": "0"}, "num_inference_steps"),
    ({"num_frames": "0"}, "num_frames"),
    ({"size": "banana"}, "size"),
    ({"guidance_scale": "-1"}, "guidance_scale"),
]


@pytest.mark.parametrize("fields,needle", BAD_VIDEO, ids=[str(f) for f, _ in BAD_VIDEO])
@pytest.mark.parametrize("server", ["wan"], indirect=True)
def test_bad_video_request_gets_clear_400(server, fields, needle) -> None:
    base = {"num_frames": "5"} if "width" in fields else {"size": "32x32", "num_frames": "5"}
    resp = video_sync(server, **{**base, **fields})
    assert resp.status_code == 400, resp.text[:300]
    err = resp.json()["error"]
    assert needle in err["message"], err
    assert video_sync(server, size="32x32", num_frames=5).status_code == 200  # still serving


BAD_IMAGE = [
    ({"size": "30x30"}, "multiple of 16"),
    ({"num_inference_steps": 0}, "num_inference_steps"),
    ({"num_inference_steps": 1}, "num_inference_steps"),  # Qwen-Image's scheduler gives NaN for 1 step
    ({"size": "abc"}, "size"),
    ({"prompt": None}, "prompt"),
    ({"n": 0}, "'n'"),
]


@pytest.mark.parametrize("fields,needle", BAD_IMAGE, ids=[str(f) for f, _ in BAD_IMAGE])
@pytest.mark.parametrize("server", ["qwen"], indirect=True)
def test_bad_image_request_gets_clear_400(server, fields, needle) -> None:
    body = {**IMAGE, "size": "32x32", **fields}
    body = {k: v for k, v in body.items() if v is not None}
    resp = requests.post(server.url + "/v1/images/generations", json=body, timeout=120)
    assert resp.status_code == 400, resp.text[:300]
    assert needle in resp.json()["error"]["message"]
    assert image_gen(server, size="32x32").status_code == 200  # still serving


def test_stock_accepts_bad_size_silently(server_pool) -> None:
    """The bug behind the validate-diffusion-requests patch: without it, 30x30 becomes 16x16 with HTTP 200."""
    stock = server_pool.get("wan-stock")
    assert "validate-diffusion-requests" in stock.log_text().split("skipped=")[-1]
    resp = video_sync(stock, size="30x30", num_frames=5)
    assert resp.status_code == 200
    assert decode_mp4(resp.content)[1:] == (16, 16)
    assert video_sync(server_pool.get("wan"), size="30x30", num_frames=5).status_code == 400


def test_unknown_model_path_fails_fast_with_clear_error(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    t0 = time.monotonic()
    proc = subprocess.run(
        [vllm_omni_exe(), "serve", str(missing), "--omni", "--port", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-2000:]
    assert f"model path {missing} does not exist" in out
    assert "Traceback" not in out
    print(f"failed in {time.monotonic() - t0:.1f} s")


@pytest.mark.parametrize("switch,expected", [("0", "UnspecifiedOmniPlatform"), ("auto", "CpuOmniPlatform")])
def test_cpu_platform_switch(switch: str, expected: str) -> None:
    code = "from vllm_omni.platforms import current_omni_platform as p; print('PLATFORM', type(p).__name__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMNI_EXT_CPU_PLATFORM": switch})
    assert f"PLATFORM {expected}" in proc.stdout, proc.stdout[-1000:] + proc.stderr[-2000:]
