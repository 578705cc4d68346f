"""A model started by its Hugging Face repo id gets the same omni-ext behaviour as one started from its
folder (issue 35, item 1).

The tiny Wan and the tiny Qwen-Image are laid into a hub cache (:func:`tests.helpers.hf_cache_model`)
as ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` and ``Qwen/Qwen-Image`` and served by those ids with
``HF_HUB_OFFLINE=1``: vLLM-Omni resolves them from the cache, and every route omni-ext adds must work
as it does for a folder: sync and async videos, images, edits (refused: the tiny Qwen-Image does not
edit), ``/v1/omni_ext/info`` and ``/playground``. Both servers start once, together, for the module.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from omni_ext.api.playground import CSP
from tests.helpers import VIDEO, hf_cache_model, image_gen, png_from, serve_models, video_sync
from tests.media import decode_mp4, decode_png

WAN_ID = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
QWEN_ID = "Qwen/Qwen-Image"
#: name -> (tiny model, the repo id it is served as)
MODELS = {"wan": ("wan2.1-t2v", WAN_ID), "qwen": ("qwen-image", QWEN_ID)}
SMALL_VIDEO = {"size": "64x64", "num_frames": 9, "num_inference_steps": 2}


def hub_env(cache_root: Path) -> dict[str, str]:
    """What points huggingface_hub (and so vLLM, vLLM-Omni, diffusers, transformers) at the cache, offline."""
    hub = str(cache_root / "hub")
    return {"HF_HOME": str(cache_root), "HF_HUB_CACHE": hub, "HUGGINGFACE_HUB_CACHE": hub, "HF_HUB_OFFLINE": "1"}


def resolve_offline(cache_root: Path, repo_id: str) -> dict[str, str]:
    """What a fresh process with :func:`hub_env` resolves ``repo_id`` to: the snapshot folder and the
    cached model_index.json (huggingface_hub reads HF_HOME when it is imported, hence the process)."""
    code = ("import json, sys, huggingface_hub as h; r = sys.argv[1]; "
            "print(json.dumps({'snapshot': h.snapshot_download(r, local_files_only=True), "
            "'index': h.try_to_load_from_cache(r, 'model_index.json')}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    out = subprocess.run([sys.executable, "-c", code, repo_id], env={**env, **hub_env(cache_root)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- the cache layout (no server) ----------------------------------------------------------------
def test_hf_cache_model_lays_a_folder_out_as_the_hub_cache(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    import huggingface_hub

    model = tiny_models["qwen-image"]
    snapshot = hf_cache_model(model, tmp_path, QWEN_ID)
    repo = tmp_path / "hub" / "models--Qwen--Qwen-Image"
    commit = (repo / "refs" / "main").read_text()
    assert len(commit) == 40 and int(commit, 16) >= 0
    assert snapshot == repo / "snapshots" / commit
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file())
    assert sorted(p.relative_to(snapshot) for p in snapshot.rglob("*") if p.is_file()) == files
    for rel in files:  # blobs behind relative symlinks, as huggingface_hub writes them; same bytes
        link = snapshot / rel
        assert link.is_symlink() and not os.path.isabs(os.readlink(link))
        assert link.resolve().parent == (repo / "blobs").resolve()
        assert link.read_bytes() == (model / rel).read_bytes()
    cached = huggingface_hub.try_to_load_from_cache(QWEN_ID, "model_index.json", cache_dir=tmp_path / "hub")
    assert cached == str(snapshot / "model_index.json")
    assert huggingface_hub.snapshot_download(QWEN_ID, cache_dir=tmp_path / "hub", local_files_only=True) == str(snapshot)
    assert resolve_offline(tmp_path, QWEN_ID) == {"snapshot": str(snapshot), "index": str(snapshot / "model_index.json")}
    # the same folder gives the same commit (laid out again, or beside another repo), copies work too
    assert hf_cache_model(model, tmp_path, QWEN_ID) == snapshot
    copied = hf_cache_model(model, tmp_path / "copies", QWEN_ID, symlinks=False)
    assert copied.name == commit and not (copied / "model_index.json").is_symlink()
    assert (copied / "model_index.json").read_bytes() == (model / "model_index.json").read_bytes()
    with pytest.raises(AssertionError, match="org/name"):
        hf_cache_model(model, tmp_path, "Qwen-Image")


# ---- both models served by repo id ---------------------------------------------------------------
@pytest.fixture(scope="module")
def hub(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """name -> the server of that model by its repo id (default executor, one worker), plus the cache."""
    cache_root = tmp_path_factory.mktemp("hf-home")
    snapshots = {name: hf_cache_model(tiny_models[tiny], cache_root, repo) for name, (tiny, repo) in MODELS.items()}
    for name, (_, repo) in MODELS.items():
        assert resolve_offline(cache_root, repo)["snapshot"] == str(snapshots[name])
    specs = {name: (repo, [], hub_env(cache_root)) for name, (_, repo) in MODELS.items()}
    t0 = time.monotonic()
    with serve_models(tmp_path_factory.mktemp("hub-servers"), specs) as procs:
        print(f"\n[hub] both servers ready after {time.monotonic() - t0:.1f} s")
        for proc in procs.values():
            assert proc.command()[2] in (WAN_ID, QWEN_ID)  # served by the id, not a folder
        yield {"servers": procs, "snapshots": snapshots, "cache_root": cache_root}


def _folder_limits(snapshot: Path):
    """omni-ext's limits for the same model read from its folder: what the id must give too."""
    from omni_ext.api.validation import limits_for_model

    return limits_for_model(str(snapshot))


def _info(server) -> dict:
    resp = requests.get(server.url + "/v1/omni_ext/info", timeout=30)
    assert resp.status_code == 200, resp.text[:1000]
    return resp.json()


def _openai_error(resp: requests.Response) -> dict:
    assert resp.headers.get("content-type", "").startswith("application/json"), (resp.status_code, resp.text[:500])
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"], err
    return err


def _png(side: int = 64) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 40, 40)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.server
def test_qwen_by_id_generates_images(hub) -> None:
    server = hub["servers"]["qwen"]
    resp = image_gen(server, size="64x64", num_inference_steps=2)
    assert resp.status_code == 200, resp.text[:1000]
    assert decode_png(png_from(resp)).shape[:2] == (64, 64)


@pytest.mark.server
def test_qwen_by_id_refuses_edits_as_a_non_edit_model(hub) -> None:
    server = hub["servers"]["qwen"]
    resp = requests.post(server.url + "/v1/images/edits", files={"prompt": (None, "make it blue"),
                                                                 "image": ("a.png", _png(), "image/png")}, timeout=120)
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:1000])
    err = _openai_error(resp)
    # the folder-served tiny Qwen-Image answers 400 unsupported_model naming its pipeline (tests/test_api.py)
    assert resp.status_code == 400 and err["code"] == "unsupported_model", (resp.status_code, err)
    assert "QwenImagePipeline" in err["message"], err


@pytest.mark.server
def test_qwen_by_id_info_and_playground(hub) -> None:
    server = hub["servers"]["qwen"]
    _check_playground(server)
    info, lim = _info(server), _folder_limits(hub["snapshots"]["qwen"])
    assert lim.pipeline == "QwenImagePipeline" and not lim.is_video
    assert info["model"] == QWEN_ID, json.dumps(info)
    assert (info["pipeline"], info["kind"], info["family"]) == ("QwenImagePipeline", "image", "qwen-image"), json.dumps(info)
    assert info["spatial_multiple"] == lim.spatial_multiple and info["sizes"], json.dumps(info)
    assert info["guidance"]["field"] == "true_cfg_scale", json.dumps(info)


@pytest.mark.server
def test_wan_by_id_info_and_playground(hub) -> None:
    server = hub["servers"]["wan"]
    _check_playground(server)
    info, lim = _info(server), _folder_limits(hub["snapshots"]["wan"])
    assert lim.pipeline == "WanPipeline" and lim.is_video
    assert info["model"] == WAN_ID, json.dumps(info)
    assert (info["pipeline"], info["kind"]) == ("WanPipeline", "video"), json.dumps(info)
    assert info["native"] == {"width": 832, "height": 480, "num_frames": 81, "fps": 16, "steps": 50}, json.dumps(info)
    assert info["spatial_multiple"] == lim.spatial_multiple and info["sizes"], json.dumps(info)
    assert info["guidance"]["field"] == "guidance_scale", json.dumps(info)


def _check_playground(server) -> None:
    page = requests.get(server.url + "/playground", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.text[:500]
    assert page.headers["content-security-policy"] == CSP and "<script src=" in page.text
    assert requests.get(server.url + "/", allow_redirects=False, timeout=30).headers.get("location") == "/playground"


@pytest.mark.server
def test_wan_by_id_sync_video(hub) -> None:
    server = hub["servers"]["wan"]
    resp = video_sync(server, **SMALL_VIDEO)
    assert resp.status_code == 200, resp.text[:1000]
    assert resp.headers["content-type"] == "video/mp4"
    assert decode_mp4(resp.content) == (9, 64, 64)


@pytest.mark.server
def test_wan_by_id_async_video(hub) -> None:
    server = hub["servers"]["wan"]
    body = {**VIDEO, **{k: str(v) for k, v in SMALL_VIDEO.items()}}
    created = requests.post(server.url + "/v1/videos", files={k: (None, v) for k, v in body.items()}, timeout=60)
    assert created.status_code == 200, created.text[:1000]
    video_id = created.json()["id"]
    deadline, job = time.monotonic() + 300, {}
    while time.monotonic() < deadline:
        job = requests.get(f"{server.url}/v1/videos/{video_id}", timeout=30).json()
        if job.get("status") in ("completed", "failed"):
            break
        time.sleep(0.2)
    assert job.get("status") == "completed", job
    content = requests.get(f"{server.url}/v1/videos/{video_id}/content", timeout=60)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4", content.text[:500]
    assert decode_mp4(content.content) == (9, 64, 64)
    # the same request, seed included, as the sync route's: the same bytes
    assert content.content == video_sync(server, **SMALL_VIDEO).content
