"""Registered classes without an entry of their own, on the real serving path: no harm from omni-ext
(issue 35, item 3).

The tiny Wan and the tiny Qwen-Image are relabelled as other classes vLLM-Omni registers on the same
architecture (their ``model_index.json``'s ``_class_name``), as a checkpoint of that class says:

- ``WanDMDPipeline`` (FastWan, 3 steps): vLLM-Omni's registered Wan topology runs it as ``WanPipeline``,
  so omni-ext's tuned Wan runs it (the DMD sampler comes from the model's ``model_index.json``);
- ``WanT2VDMD2Pipeline`` and ``QwenImageDMD2Pipeline`` (DMD2 distillations; they start at all only with
  omni-ext's ``dmd2-forward-kwargs`` patch): no tuned class, and they derive from classes that cancel at
  a step boundary, so under the TunedExecutor at ``data_parallel_size`` 2 vLLM-Omni's own executor runs
  them (a per-step all-reduce over every rank would hang data-parallel groups running different jobs).
  The Qwen-Image one is served with omni-ext's ``cancel-at-step`` switched off on its TunedExecutor
  server, so that it takes the third path: vLLM-Omni's pipeline, one request per data-parallel group.

Each is served twice, by vLLM-Omni's default executor and by the TunedExecutor at data parallel 2, and
must give the same bytes for the same seed; the DMD2 servers must stop a running job at its next step
on ``DELETE``; ``/v1/omni_ext/info`` says which executor really runs the model and why.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import time
from pathlib import Path

import pytest
import requests

from omni_ext.models.tiny import RELABELLED as TINY_OF
from omni_ext.models.tiny import relabel
from tests.helpers import serve_models

TUNED_DP2 = ["--distributed-executor-backend", "omni_ext.executor.TunedExecutor",
             "--additional-config", json.dumps({"omni_ext": {"data_parallel_size": 2}})]
#: name -> (tiny model, class it is relabelled as, extra model_index.json keys)
RELABELLED = {
    "fastwan": ("wan2.1-t2v", "WanDMDPipeline", {}),
    # 40 DMD2 steps (its checkpoints ship 4) so that a 256x256 job runs long enough to be cancelled mid-way.
    "wan-dmd2": ("wan2.1-t2v", "WanT2VDMD2Pipeline", {"dmd2_config": {"num_inference_steps": 40}}),
    "qwen-dmd2": ("qwen-image", "QwenImageDMD2Pipeline", {}),
}
#: Not cancellable at a step boundary: the TunedExecutor runs vLLM-Omni's pipeline on whole groups.
WHOLE_GROUP_ENV = {"OMNI_EXT_DISABLE_PATCHES": "cancel-at-step"}
VIDEO = {"prompt": "a red fox running through fresh snow", "size": "64x64", "num_frames": 9, "seed": 11}
IMAGE = {"prompt": "a lighthouse at dusk", "size": "64x64", "seed": 11, "num_inference_steps": 4}


def test_the_relabelled_classes_are_the_tiny_models_table() -> None:
    """``omni-ext models`` names the tiny model each class is tested on from omni_ext.models.tiny.RELABELLED."""
    assert {cls: tiny for tiny, cls, _ in RELABELLED.values()} == TINY_OF


@pytest.fixture(scope="module")
def servers(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("relabelled")
    specs = {}
    for name, (tiny, cls, extra) in RELABELLED.items():
        model = str(relabel(tiny_models[tiny], root / name, cls, extra))
        specs[f"{name}-stock"] = (model, [], {})
        specs[f"{name}-tuned"] = (model, TUNED_DP2, WHOLE_GROUP_ENV if name == "qwen-dmd2" else {})
    with serve_models(tmp_path_factory.mktemp("relabelled-servers"), specs) as procs:
        yield procs


def _video(server, **fields) -> bytes:
    resp = requests.post(server.url + "/v1/videos/sync", json={**VIDEO, **fields}, timeout=300)
    assert resp.status_code == 200 and resp.headers["content-type"] == "video/mp4", resp.text[:1000]
    return resp.content


def _image(server, **fields) -> bytes:
    resp = requests.post(server.url + "/v1/images/generations", json={**IMAGE, **fields}, timeout=300)
    assert resp.status_code == 200, resp.text[:1000]
    return base64.b64decode(resp.json()["data"][0]["b64_json"])


def _layout(server) -> dict:
    resp = requests.get(server.url + "/v1/omni_ext/info", timeout=30)
    assert resp.status_code == 200, resp.text[:1000]
    return resp.json()["layout"]


@pytest.mark.server
@pytest.mark.parametrize("name", ["fastwan", "wan-dmd2", "qwen-dmd2"])
def test_relabelled_class_gives_stocks_bytes_under_the_tuned_executor_at_dp2(servers, name: str) -> None:
    """Videos reach /v1/videos (vLLM-Omni's metadata says video; neither Wan name holds "Video"). Two
    requests at once on the dp-2 server: no collective across its groups hangs (the Qwen-Image one runs
    them on its two groups), and each gives vLLM-Omni's executor's bytes."""
    generate = _image if name.startswith("qwen") else _video
    stock, tuned = servers[f"{name}-stock"], servers[f"{name}-tuned"]
    assert generate(tuned) == generate(stock)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda seed: generate(tuned, seed=seed), (11, 12)))
    assert runs == [generate(stock, seed=11), generate(stock, seed=12)]


@pytest.mark.server
def test_info_names_the_executor_that_really_runs_the_model(servers) -> None:
    fastwan = _layout(servers["fastwan-tuned"])
    assert fastwan["executor"] == "TunedExecutor" and fastwan["data_parallel_size"] == 2, fastwan
    layout = _layout(servers["wan-dmd2-tuned"])
    assert layout["executor"] == "vLLM-Omni" and "cancellation" in layout["why"], layout
    assert layout["priorities"] is False
    layout = _layout(servers["qwen-dmd2-tuned"])  # not cancellable: one request per data-parallel group
    assert layout["executor"] == "TunedExecutor" and "one request per data-parallel group" in layout["why"], layout
    assert _layout(servers["wan-dmd2-stock"])["executor"] == "vLLM-Omni"


@pytest.mark.server
def test_delete_stops_a_running_dmd2_job_at_its_next_step_on_the_dp2_server(servers) -> None:
    """vLLM-Omni's own cancellation (the class derives from Wan22Pipeline, which omni-ext opts in) keeps
    working where the TunedExecutor hands the model to vLLM-Omni's executor."""
    server = servers["wan-dmd2-tuned"]
    job = requests.post(server.url + "/v1/videos", json={**VIDEO, "size": "256x256", "num_frames": 17}, timeout=60).json()
    seen: list[tuple[float, int]] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        body = requests.get(f"{server.url}/v1/videos/{job['id']}", timeout=30).json()
        if body["progress"] > 0:
            seen.append((time.monotonic(), body["progress"]))
        if len(seen) >= 2 and seen[-1][1] >= seen[0][1] + 5:
            break
        assert body["status"] in ("queued", "in_progress"), body
        time.sleep(0.05)
    (t0, p0), (t1, p1) = seen[0], seen[-1]
    assert p1 < 60, f"the job ran too fast to be cancelled mid-way: {seen}"
    remaining_s = (100 - p1) * (t1 - t0) / (p1 - p0)
    start = time.monotonic()
    resp = requests.delete(f"{server.url}/v1/videos/{job['id']}", timeout=60)
    assert resp.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    _video(server, size="64x64", num_frames=5)  # the engine is free again
    took = time.monotonic() - start
    assert took < remaining_s / 2, f"cancel + a tiny job took {took:.1f} s; the cancelled job had {remaining_s:.1f} s left"
