"""Pure logic behind the API routes: form keys, the job store, progress files, poll intervals, settings."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_ext import progress
from omni_ext.api.errors import APIError
from omni_ext.api.forms import _set_nested
from omni_ext.api.jobs import Job, JobStore
from omni_ext.api.settings import load_settings
from omni_ext.api.state import ApiState
from omni_ext.api.validation import ModelLimits
from omni_ext.api.videos import poll_after_ms


def test_bracketed_form_keys() -> None:
    out: dict = {}
    for k, v in [("extra_params[a]", "1"), ("extra_params[b][c]", "2"), ("tags[]", "x"), ("tags[]", "y"), ("p", "q")]:
        _set_nested(out, k, v)
    assert out == {"extra_params": {"a": "1", "b": {"c": "2"}}, "tags": ["x", "y"], "p": "q"}
    with pytest.raises(APIError):
        _set_nested({"tags": ["x"]}, "tags[a]", "1")


def _jobs(store: JobStore, n: int) -> list[Job]:
    return [store.add(Job(id=f"video_{i:02d}", kind="video", created_at=1000 + i)) for i in range(n)]


def test_store_pagination_both_orders(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "j.sqlite")
    _jobs(store, 5)
    store.add(Job(id="img_1", kind="image"))
    page, more = store.list("video", after=None, limit=2, order="asc")
    assert [j.id for j in page] == ["video_00", "video_01"] and more
    page, more = store.list("video", after="video_03", limit=2, order="asc")
    assert [j.id for j in page] == ["video_04"] and not more
    page, more = store.list("video", after="video_03", limit=10, order="desc")
    assert [j.id for j in page] == ["video_02", "video_01", "video_00"] and not more
    with pytest.raises(KeyError):
        store.list("video", after="img_1", limit=1, order="asc")


def test_store_survives_reopen_and_fails_interrupted(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "j.sqlite")
    a, b, c = _jobs(store, 3)
    a.status, a.media, a.meta = "completed", {"video": "a.mp4"}, {"fps": 16}
    b.status = "in_progress"
    store.save(a)
    store.save(b)
    store.close()
    reopened = JobStore(tmp_path / "j.sqlite")
    assert sorted(reopened.fail_interrupted(now=5)) == ["video_01", "video_02"]
    assert reopened.get("video_00").media == {"video": "a.mp4"} and reopened.get("video_00").meta == {"fps": 16}
    failed = reopened.get("video_01")
    assert failed.status == "failed" and failed.error_code == "server_restarted" and failed.completed_at == 5
    assert reopened.fail_interrupted() == []


def test_expiry_sweep_removes_media_keeps_record(tmp_path: Path) -> None:
    settings = load_settings(SimpleNamespace(port=1, additional_config=None), {"OMNI_EXT_API_DATA_DIR": str(tmp_path)})
    settings.media_dir.mkdir(parents=True)
    store = JobStore(settings.db_path)
    state = ApiState(settings=settings, store=store, model_name="m", model_path="m",
                     limits=ModelLimits("WanPipeline", 16, 1, True))
    (settings.media_dir / "old.mp4").write_bytes(b"x")
    (settings.media_dir / "new.mp4").write_bytes(b"y")
    store.add(Job(id="video_old", kind="video", status="completed", expires_at=int(time.time()) - 1, media={"video": "old.mp4"}))
    store.add(Job(id="video_new", kind="video", status="completed", expires_at=int(time.time()) + 999, media={"video": "new.mp4"}))
    assert asyncio.run(state.sweep_expired()) == 1
    assert not (settings.media_dir / "old.mp4").exists() and (settings.media_dir / "new.mp4").exists()
    assert store.get("video_old").media == {} and store.get("video_old").meta["expired"] is True


def test_settings_channels(tmp_path: Path) -> None:
    args = SimpleNamespace(port=8123, additional_config='{"omni_ext": {"api": {"ttl_s": 60, "max_upload_mb": 1}}}')
    s = load_settings(args, {})
    assert s.ttl_s == 60 and s.max_upload_bytes == 2**20 and s.data_dir.name == "port-8123"
    s = load_settings(args, {"OMNI_EXT_API_TTL_S": "5", "OMNI_EXT_API_DATA_DIR": str(tmp_path)})
    assert s.ttl_s == 5 and s.data_dir == tmp_path


def test_progress_files_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.ENV, str(tmp_path))
    assert progress.read_progress("video_a") is None
    progress.write_progress(["video_a-1234abcd", "video_b-0000aaaa", "../evil"], 5, 20, time.time() - 1.0)
    p = progress.read_progress("video_a")
    assert p is not None and (p.done, p.total) == (5, 20) and p.fraction == 0.25
    assert 2.0 < p.remaining_s() < 4.0  # 1 s for 5 steps -> ~3 s for the other 15
    assert not (tmp_path.parent / "evil").exists()
    progress.clear_progress("video_a")
    assert progress.read_progress("video_a") is None and progress.read_progress("video_b") is not None


def test_stale_progress_dirs_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(progress.ENV, raising=False)
    stale = tmp_path / "omni-ext-progress" / "999999999"
    stale.mkdir(parents=True)
    path = progress.ensure_progress_dir(tmp_path)
    assert path == tmp_path / "omni-ext-progress" / str(os.getpid()) and path.is_dir() and not stale.exists()


@pytest.mark.parametrize("remaining,expected", [(None, 1000), (0.0, 100), (2.0, 500), (100.0, 5000)])
def test_poll_after_ms(remaining, expected) -> None:
    assert poll_after_ms(remaining) == expected


def _wan_state(tmp_path: Path) -> ApiState:
    settings = load_settings(SimpleNamespace(port=1, additional_config=None), {"OMNI_EXT_API_DATA_DIR": str(tmp_path)})
    return ApiState(settings=settings, store=JobStore(settings.db_path), model_name="m", model_path="m",
                    limits=ModelLimits("WanPipeline", 16, 1, True))


def test_seconds_and_size_map_to_native_or_configured_defaults(tmp_path: Path) -> None:
    from omni_ext.api.forms import Body
    from omni_ext.api.videos import build_video_request

    state = _wan_state(tmp_path)
    _, _, facts = build_video_request(Body({"prompt": "x", "seconds": "5"}), state)
    assert (facts["width"], facts["height"], facts["num_frames"], facts["fps"]) == (832, 480, 81, 16)  # Wan2.1 native
    _, _, facts = build_video_request(Body({"prompt": "x"}), state)
    assert (facts["num_frames"], facts["seconds"]) == (81, "5")
    # a preset's configured defaults win over the native ones
    _, _, facts = build_video_request(Body({"prompt": "x"}), state, {"width": 320, "height": 192, "num_frames": 17})
    assert (facts["width"], facts["height"], facts["num_frames"]) == (320, 192, 17)
    with pytest.raises(APIError) as err:
        build_video_request(Body({"prompt": "x", "seconds": "2", "size": "100x100"}), state)
    assert err.value.status == 400 and "multiple of 16" in err.value.message
