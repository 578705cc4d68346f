"""Pure logic behind the API routes: form keys and fields, the job store, progress files, poll intervals,
settings, request limits against the OpenAPI schemas, the video backend resolved once."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_ext import progress
from omni_ext.api import limits, media, schemas
from omni_ext.api.errors import APIError, StorageError
from omni_ext.api.intake import Body, _set_nested, bounded_int, build_video_request, parse_size
from omni_ext.api.jobs import Job, JobStore
from omni_ext.api.settings import load_settings
from omni_ext.api.tenants import SINGLE_TENANT
from omni_ext.api.state import ApiState, get_state, native_video_defaults, resolve_video_backend, video_state
from omni_ext.api.intake import ModelLimits
from omni_ext.api.validation import limits_for_model
from omni_ext.api.videos import poll_after_ms
from tests.helpers import api_state


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


def test_expiry_sweep_removes_finished_jobs_with_their_media(tmp_path: Path) -> None:
    state = _wan_state(tmp_path)
    settings, store = state.settings, state.store
    past, future = int(time.time()) - 1, int(time.time()) + 999
    for name in ("old.mp4", "new.mp4"):
        (settings.media_dir / name).write_bytes(b"x" * 10)
    state.media_bytes = 20
    store.add(Job(id="video_old", kind="video", status="completed", expires_at=past, media={"video": "old.mp4"}))
    store.add(Job(id="video_new", kind="video", status="completed", expires_at=future, media={"video": "new.mp4"}))
    store.add(Job(id="video_bad", kind="video", status="failed", expires_at=past, error_code="generation_failed"))
    store.add(Job(id="video_run", kind="video", status="in_progress", expires_at=past))  # never while it runs
    assert state.sweep_expired() == 2
    assert not (settings.media_dir / "old.mp4").exists() and (settings.media_dir / "new.mp4").exists()
    assert store.get("video_old") is None and store.get("video_bad") is None  # the record goes with its media
    assert store.get("video_new") is not None and store.get("video_run") is not None
    assert state.media_bytes == 10


def test_interrupted_jobs_fail_and_expire_like_finished_ones(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "j.sqlite")
    store.add(Job(id="video_q", kind="video", status="queued"))
    assert store.fail_interrupted(now=100, ttl_s=60) == ["video_q"]
    assert store.get("video_q").expires_at == 160 and [j.id for j in store.expired(now=160)] == ["video_q"]


def test_store_quota_drops_expired_results_first_then_answers_507(tmp_path: Path) -> None:
    state = _wan_state(tmp_path)
    state.settings = replace(state.settings, max_store_bytes=100)
    past = int(time.time()) - 1

    async def scenario() -> None:
        await state.write_media("a.mp4", b"a" * 60)
        state.store.add(Job(id="video_a", kind="video", status="completed", expires_at=past, media={"video": "a.mp4"}))
        await state.write_media("b.mp4", b"b" * 30)
        state.store.add(Job(id="video_b", kind="video", status="completed", media={"video": "b.mp4"}))
        assert state.media_bytes == 90 and not state.store_full(10) and state.store_full(11)
        await state.write_media("c.mp4", b"c" * 50)  # no room: the expired video goes, the live one stays
        assert state.store.get("video_a") is None and not (state.settings.media_dir / "a.mp4").exists()
        assert state.media_bytes == 80 and (state.settings.media_dir / "b.mp4").exists()
        with pytest.raises(StorageError) as err:  # live results fill it: 507, and nothing was written
            await state.write_media("d.mp4", b"d" * 21)
        assert (err.value.status, err.value.code) == (507, "storage_full") and "max_store_mb" in err.value.message
        assert not (state.settings.media_dir / "d.mp4").exists() and state.media_bytes == 80
        state.ensure_room(20)  # exactly full is allowed

    asyncio.run(scenario())


def test_store_use_is_counted_at_start(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "x.mp4").write_bytes(b"1" * 7)
    (tmp_path / "m" / "sub").mkdir()
    assert media.stored_bytes(tmp_path / "m") == 7 and media.stored_bytes(tmp_path / "none") == 0
    assert load_settings(SimpleNamespace(additional_config={"omni_ext": {"api": {"max_store_mb": 1.5}}}),
                         {}).max_store_bytes == int(1.5 * 2**20)
    with pytest.raises(ValueError, match="max_store_mb"):
        load_settings(SimpleNamespace(), {"OMNI_EXT_API_MAX_STORE_MB": "-1"})


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


def test_step_reports_carry_the_start_markers_mode_and_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.ENV, str(tmp_path))
    assert progress.read_marker("video_a-1234abcd") is None  # no marker (vLLM-Omni's own executor)
    progress.mark_started(["video_a-1234abcd"], 20, "single")  # the TunedExecutor hands it to a rank
    t_job, mode = progress.read_marker("video_a-1234abcd")
    assert mode == "single" and abs(t_job - time.time()) < 5
    p = progress.read_progress("video_a")
    assert (p.done, p.mode, p.started_at, p.before_loop_s) == (0, "single", t_job, 0.0)
    # the lead rank's step reports replace the file: the loop's start, and the marker carried on
    progress.write_progress(["video_a-1234abcd"], 3, 20, t_job + 0.5, "single", t_job)
    p = progress.read_progress("video_a")
    assert (p.done, p.t_start, p.mode, p.started_at) == (3, pytest.approx(t_job + 0.5), "single", pytest.approx(t_job))
    assert p.before_loop_s == pytest.approx(0.5)
    assert progress.read_marker("video_a-1234abcd") == (pytest.approx(t_job), "single")  # a second loop's bar
    progress.write_progress(["video_b-0000aaaa"], 1, 4, t_job)  # vLLM-Omni's executor: no marker, no mode
    p = progress.read_progress("video_b")
    assert (p.mode, p.t_job, p.started_at) == (None, None, pytest.approx(t_job))


def test_stale_progress_dirs_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(progress.ENV, "unset")  # recorded, so the variable ensure_progress_dir sets is undone
    monkeypatch.delenv(progress.ENV)
    stale = tmp_path / "omni-ext-progress" / "999999999"
    stale.mkdir(parents=True)
    path = progress.ensure_progress_dir(tmp_path)
    assert path == tmp_path / "omni-ext-progress" / str(os.getpid()) and path.is_dir() and not stale.exists()


@pytest.mark.parametrize("remaining,expected", [(None, 1000), (0.0, 100), (2.0, 500), (100.0, 5000)])
def test_poll_after_ms(remaining, expected) -> None:
    assert poll_after_ms(remaining) == expected


def _wan_state(tmp_path: Path) -> ApiState:
    return api_state(tmp_path, ModelLimits("WanPipeline", 16, 1, True))


def test_seconds_and_size_map_to_native_or_configured_defaults(tmp_path: Path) -> None:
    state = _wan_state(tmp_path)
    native = native_video_defaults(state.limits)
    assert native == {"width": 832, "height": 480, "num_frames": 81, "fps": 16}  # Wan2.1's, from the family table
    spec = build_video_request(Body({"prompt": "x", "seconds": "5"}), state, native)
    assert (spec.width, spec.height, spec.frames, spec.fps) == (832, 480, 81, 16)
    spec = build_video_request(Body({"prompt": "x"}), state, native)
    assert (spec.frames, spec.seconds) == (81, "5")
    # a preset's configured defaults win over the native ones
    configured = {**native, "width": 320, "height": 192, "num_frames": 17}
    spec = build_video_request(Body({"prompt": "x"}), state, configured)
    assert (spec.width, spec.height, spec.frames) == (320, 192, 17)
    with pytest.raises(APIError) as err:
        build_video_request(Body({"prompt": "x", "seconds": "2", "size": "100x100"}), state, native)
    assert err.value.status == 400 and "multiple of 16" in err.value.message
    assert native_video_defaults(ModelLimits("QwenImagePipeline", 16, 2, False)) == {}
    assert native_video_defaults(ModelLimits("SomeNewVideoPipeline", 16, 1, True)) == {}


# ---- limits: declared once (omni_ext.api.limits), documented by the schemas, enforced by the routes ----
VIDEO_BOUNDS = {
    "num_inference_steps": (limits.MIN_STEPS, limits.MAX_VIDEO_STEPS),
    "guidance_scale": (0, limits.MAX_VIDEO_GUIDANCE),
    "guidance_scale_2": (0, limits.MAX_VIDEO_GUIDANCE),
    "true_cfg_scale": (0, limits.MAX_VIDEO_GUIDANCE),
    "seed": (0, limits.MAX_SEED),
    "width": (1, None),
    "height": (1, None),
    "num_frames": (1, limits.MAX_FRAMES),
    "fps": (1, limits.MAX_FPS),
    "boundary_ratio": (0, 1),
    "priority": (limits.MIN_PRIORITY, limits.MAX_PRIORITY),
    "num_outputs_per_prompt": (1, 1),  # one video per job
    "frame_interpolation_exp": (1, 2**63 - 1),  # vLLM-Omni's own field, from its pydantic model
}
IMAGE_BOUNDS = {
    "n": (1, limits.MAX_OUTPUTS),
    "output_compression": (0, limits.MAX_COMPRESSION),
    "num_inference_steps": (limits.MIN_STEPS, limits.MAX_STEPS),
    "guidance_scale": (0, None),
    "true_cfg_scale": (0, None),
    "seed": (0, limits.MAX_SEED),
    "priority": (limits.MIN_PRIORITY, limits.MAX_PRIORITY),
    "partial_images": (0, 3),  # sent with stream: true (the test adds it)
}


def _schema_bounds(schema: dict) -> dict:
    return {name: (prop.get("minimum"), prop.get("maximum"))
            for name, prop in schema["properties"].items() if "minimum" in prop or "maximum" in prop}


def test_schemas_declare_the_limits_constants() -> None:
    assert _schema_bounds(schemas.VIDEO_CREATE) == VIDEO_BOUNDS
    assert _schema_bounds(schemas.IMAGE_GENERATE) == IMAGE_BOUNDS
    seconds = re.compile(schemas.VIDEO_CREATE["properties"]["seconds"]["pattern"])
    assert [s for s in map(str, range(-1, 200)) if seconds.match(s)] == [str(i) for i in range(1, limits.MAX_SECONDS + 1)]
    assert not any(seconds.match(s) for s in ("01", "4.0", " 4", "4 ", ""))
    size = re.compile(schemas.IMAGE_GENERATE["properties"]["size"]["oneOf"][0]["pattern"])
    assert size.match("9" * limits.SIZE_DIGITS + "x1") and not size.match("9" * (limits.SIZE_DIGITS + 1) + "x1")


def test_video_bounds_are_vllm_omnis() -> None:
    """/v1/videos builds vLLM-Omni's VideoGenerationRequest: the limits that mirror its bounds must match them."""
    from vllm_omni.entrypoints.openai.protocol.videos import VideoGenerationRequest

    def upper(name: str) -> float:
        return next(m.le for m in VideoGenerationRequest.model_fields[name].metadata if getattr(m, "le", None) is not None)

    assert upper("num_inference_steps") == limits.MAX_VIDEO_STEPS
    assert upper("guidance_scale") == upper("guidance_scale_2") == upper("true_cfg_scale") == limits.MAX_VIDEO_GUIDANCE
    assert upper("boundary_ratio") == 1 and upper("num_outputs_per_prompt") == limits.MAX_OUTPUTS


def _edges(bounds: dict) -> list[tuple[str, float, bool]]:
    """(field, value, accepted) at and just past every bound."""
    out = []
    for name, (lo, hi) in bounds.items():
        out += [(name, lo, True), (name, lo - 1, False)]
        if hi is not None:
            out += [(name, hi, True), (name, hi + 1, False)]
    return out


@pytest.mark.parametrize("name,value,accepted", _edges(VIDEO_BOUNDS) + [("seconds", "1", True), ("seconds", "0", False),
                         (("seconds", str(limits.MAX_SECONDS), True)), ("seconds", str(limits.MAX_SECONDS + 1), False)])
def test_video_route_enforces_what_the_schema_says(tmp_path: Path, name: str, value, accepted: bool) -> None:
    state = api_state(tmp_path, ModelLimits("WanPipeline", 0, 1, True))  # spatial multiple unknown: any width
    body = Body({"prompt": "x", name: value})
    if accepted:
        build_video_request(body, state, {})
    else:
        with pytest.raises(APIError) as err:
            build_video_request(body, state, {})
        assert err.value.status == 400 and name in err.value.message + str(err.value.param)


@pytest.mark.parametrize("name,value,accepted", _edges(IMAGE_BOUNDS))
def test_image_route_enforces_what_the_schema_says(tmp_path: Path, name: str, value, accepted: bool) -> None:
    from omni_ext.api.intake import build_image_request

    state = api_state(tmp_path, ModelLimits("QwenImagePipeline", 16, 1, False))
    body = {"prompt": "x", name: value, **({"stream": True} if name == "partial_images" else {})}
    if accepted:
        spec, reply = build_image_request(body, state)
        _, params = spec.request
        parsed = {"n": spec.n, "output_compression": reply.output_compression, "num_inference_steps": spec.steps,
                  "priority": spec.priority, "partial_images": reply.partial_images}.get(name, getattr(params, name, None))
        assert parsed == value
    else:
        with pytest.raises(APIError) as err:
            build_image_request(body, state)
        assert err.value.status == 400 and name in err.value.message + str(err.value.param)


def test_field_parsers() -> None:
    assert [bounded_int(v, "k", 1, 9) for v in (3, "3", " 3 ", "3.0", 3.0)] == [3] * 5
    for bad in ("3.5", "x", "", None, True, {}, [], float("nan"), float("inf")):
        with pytest.raises(APIError) as err:
            bounded_int(bad, "k", 1, 9)
        assert err.value.param == "k" and "'k' must be an integer" in err.value.message
    with pytest.raises(APIError, match="between 1 and 9, got 10"):
        bounded_int("10", "k", 1, 9)
    assert parse_size(" 832 X 480 ") == (832, 480)
    for bad in ("832x", "x480", "832*480", "123456x1"):
        with pytest.raises(APIError):
            parse_size(bad)


def test_vllm_omnis_facts_decide_video_and_reference(tmp_path: Path) -> None:
    """Video or image, and whether a reference image is taken, are vLLM-Omni's answers for the class
    (its model metadata and class flags), never a guess from the class name."""
    import io

    from PIL import Image

    for pipeline, is_video, image_input in (("WanImageToVideoPipeline", True, True), ("QwenImagePipeline", False, False),
                                            ("WanDMDPipeline", True, False), ("WanVACEPipeline", True, True),
                                            ("FooVideoPipeline", False, False), ("FluxKontextPipeline", False, True)):
        root = tmp_path / pipeline
        root.mkdir()
        (root / "model_index.json").write_text(json.dumps({"_class_name": pipeline}))
        limits = limits_for_model(str(root))
        assert (limits.is_video, limits.image_input) == (is_video, image_input), pipeline
    png = io.BytesIO()
    Image.new("RGB", (16, 16)).save(png, format="PNG")
    upload = {"input_reference": ("a.png", "image/png", png.getvalue())}
    for pipeline, accepted in (("WanPipeline", False), ("WanImageToVideoPipeline", True)):
        state = api_state(tmp_path / pipeline, ModelLimits(pipeline, 16, 1, True, image_input=accepted))
        if accepted:
            assert build_video_request(Body({"prompt": "x"}, upload), state, {}).reference.size == (16, 16)
        else:
            with pytest.raises(APIError) as err:
                build_video_request(Body({"prompt": "x"}, upload), state, {})
            assert err.value.code == "unsupported_parameter"


def test_a_text_only_model_refuses_a_reference_before_decoding_it(tmp_path: Path) -> None:
    """The model check comes first: bytes that are no image at all get the model's refusal, not a decode error."""
    state = api_state(tmp_path / "wan", ModelLimits("WanPipeline", 16, 1, True))
    with pytest.raises(APIError) as err:
        build_video_request(Body({"prompt": "x"}, {"input_reference": ("a.png", "image/png", b"not an image")}), state, {})
    assert err.value.code == "unsupported_parameter"


# ---- start-up work happens once; content is served by one function --------------------------------
class _Handler:
    def __init__(self) -> None:
        self.calls = {"defaults": 0, "stage_configs": []}

    async def _run_and_extract(self, *a, **kw):  # pragma: no cover - never called here
        raise AssertionError

    def set_stage_configs_if_missing(self, configs) -> None:
        self.calls["stage_configs"].append(configs)

    def _resolve_default_sampling_params(self):
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        self.calls["defaults"] += 1
        return OmniDiffusionSamplingParams(num_frames=17, width=320)


def test_video_backend_resolved_at_start_up_and_no_request_builds_state(tmp_path: Path) -> None:
    state = _wan_state(tmp_path)
    app_state = SimpleNamespace(engine_client=None, openai_serving_video=_Handler(), stage_configs=["stage0"])
    with pytest.raises(APIError) as err:
        resolve_video_backend(app_state, state.limits)
    assert (err.value.status, err.value.code) == (503, "engine_unavailable")
    app_state.engine_client = object()
    backend = resolve_video_backend(app_state, state.limits)
    assert app_state.openai_serving_video.calls == {"defaults": 1, "stage_configs": [["stage0"]]}
    assert backend.defaults == {"width": 320, "height": 480, "num_frames": 17, "fps": 16}  # configured over native
    with pytest.raises(APIError) as err:
        resolve_video_backend(SimpleNamespace(engine_client=object(), openai_serving_video=None), state.limits)
    assert (err.value.status, err.value.code) == (503, "video_unavailable")
    # A request never does start-up work: before the start-up hook made the state, it is answered 503.
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace()), state=SimpleNamespace(), headers={})
    for route_state in (get_state, video_state):
        with pytest.raises(APIError) as err:
            route_state(request)
        assert (err.value.status, err.value.code) == (503, "engine_unavailable")
    assert not hasattr(request.app.state, "omni_ext")
    request.app.state.omni_ext = state  # a server without a video handler
    with pytest.raises(APIError) as err:
        video_state(request)
    assert (err.value.status, err.value.code) == (503, "video_unavailable")
    state.video = backend
    assert video_state(request) == (state, backend, SINGLE_TENANT)
    state.draining = True  # a SIGTERM stopped admission: 503 with Retry-After, before the body is read
    with pytest.raises(APIError) as err:
        video_state(request)
    assert (err.value.status, err.value.code) == (503, "server_draining") and err.value.headers["retry-after"] == "10"


def test_find_job_and_read_media(tmp_path: Path) -> None:
    state = _wan_state(tmp_path)
    (state.settings.media_dir / "a.mp4").write_bytes(b"mp4")
    state.store.add(Job(id="video_a", kind="video", status="completed", media={"video": "a.mp4"}))
    state.store.add(Job(id="video_gone", kind="video", status="completed", media={"video": "gone.mp4"}))
    state.store.add(Job(id="img_old", kind="image", status="completed"))
    job = state.find_job("video", "video_a", SINGLE_TENANT)
    assert asyncio.run(state.read_media(job, "video", "The content of video video_a")) == b"mp4"
    cases = [
        (lambda: state.find_job("video", "../x", SINGLE_TENANT), 400, "invalid_id", "Invalid video id."),
        (lambda: state.find_job("video", "img_old", SINGLE_TENANT), 404, "video_not_found", "No video found with id 'img_old'."),
        (lambda: asyncio.run(state.read_media(state.find_job("image", "img_old", SINGLE_TENANT), "image", "Image img_old")),
         404, "image_expired", "Image img_old has expired."),
        (lambda: asyncio.run(state.read_media(state.find_job("video", "video_gone", SINGLE_TENANT), "video", "The content of video v")),
         404, "video_content_missing", "The content of video v is no longer stored."),
    ]
    for call, status, code, message in cases:
        with pytest.raises(APIError) as err:
            call()
        assert (err.value.status, err.value.code, err.value.message) == (status, code, message)


def test_a_reference_image_over_the_pixel_bound_is_refused_from_its_header(tmp_path: Path, monkeypatch) -> None:
    """A small PNG that would decode to a huge image (an image bomb) gets a 400 before any pixel is decoded;
    one past PIL's own bomb limit gets a 400 too, never a 500."""
    import io

    from PIL import Image

    from omni_ext.api import intake

    def png(width: int, height: int) -> bytes:
        buf = io.BytesIO()
        Image.new("1", (width, height)).save(buf, format="PNG", optimize=True)
        return buf.getvalue()

    state = api_state(tmp_path / "i2v", ModelLimits("WanImageToVideoPipeline", 16, 1, True, image_input=True))
    big, bomb = png(65, 64), png(100, 100)
    monkeypatch.setattr(intake, "max_reference_pixels", lambda: 64 * 64)
    decoded: list[object] = []
    monkeypatch.setattr(Image.Image, "load", lambda self: decoded.append(self) or None)
    with pytest.raises(APIError) as err:
        build_video_request(Body({"prompt": "x"}, {"input_reference": ("a.png", "image/png", big)}), state, {})
    assert (err.value.code, err.value.param) == ("image_too_large", "input_reference") and "65x64" in err.value.message
    assert decoded == []  # refused from the header alone
    monkeypatch.undo()
    monkeypatch.setattr(intake, "max_reference_pixels", lambda: 0)  # no bound of ours: PIL's own bomb check
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(APIError) as err:
        build_video_request(Body({"prompt": "x"}, {"input_reference": ("a.png", "image/png", bomb)}), state, {})
    assert err.value.code == "invalid_image"


def test_an_sdk_edit_reaches_vllm_omnis_edit_endpoint_checked_with_its_mask_as_mask_image(tmp_path: Path) -> None:
    """The OpenAI SDK's edit (multipart: ``image``, ``mask``, OpenAI's hints) is parsed and checked by
    omni-ext's intake, then handed to vLLM-Omni's endpoint as it reads it: ``mask`` as ``mask_image`` with
    the same bytes, b64_json, the steps ``quality`` chose, no field it does not read."""
    import asyncio

    import requests as rq
    from starlette.requests import Request

    from omni_ext.api import edits
    from omni_ext.api.intake import parse_body, replay

    mask_bytes = b'\x89PNG fake; name="mask" inside the file stays'
    state = api_state(tmp_path, ModelLimits("QwenImageEditPipeline", 16, 1, False))

    def form_of(data: dict, files: dict) -> tuple[dict, bytes, bytes]:
        prepared = rq.Request("POST", "http://x/v1/images/edits", data=data, files=files or {"x": None}).prepare()
        raw = prepared.body if isinstance(prepared.body, bytes) else prepared.body.encode()
        scope = {"type": "http", "method": "POST", "path": "/v1/images/edits", "query_string": b"",
                 "headers": [(b"content-type", prepared.headers["Content-Type"].encode()),
                             (b"content-length", str(len(raw)).encode())]}

        async def receive():
            return {"type": "http.disconnect"}

        async def run():
            body = await parse_body(Request(scope, replay(raw, receive)), 2**20)
            spec, reply = edits.check_edit(body, state)
            sent, boundary = edits.stock_form(body, spec)
            stock_scope = {**scope, "headers": [(b"content-type", b"multipart/form-data; boundary=" + boundary),
                                                (b"content-length", str(len(sent)).encode())]}
            form = await Request(stock_scope, replay(sent, receive)).form()
            return {k: (await v.read() if hasattr(v, "read") else v) for k, v in form.multi_items()}, spec, reply

        return asyncio.run(run())

    fields, spec, reply = form_of({"prompt": "p", "model": "m", "quality": "low", "response_format": "url",
                                   "input_fidelity": "high", "n": "2"},
                                  {"image": ("a.png", b"img", "image/png"), "mask": ("m.png", mask_bytes, "image/png")})
    assert fields == {"prompt": "p", "n": "2", "response_format": "b64_json",
                      "num_inference_steps": str(spec.steps), "image": b"img", "mask_image": mask_bytes}
    assert reply.response_format == "url" and set(reply.ignored) == {"input_fidelity"} and spec.n == 2
    for data, files, param in (
            ({"prompt": "p", "priority": "1"}, {"image": ("a.png", b"i", "image/png")}, "priority"),
            ({"prompt": "p"}, {"image": ("a.png", b"i", "image/png"), "photo": ("b.png", b"i", "image/png")}, "photo"),
            ({"prompt": "p"}, {}, "image"),
            ({"prompt": "p", "strength": "2"}, {"image": ("a.png", b"i", "image/png")}, "strength"),
            ({"prompt": "p", "background": "transparent"}, {"image": ("a.png", b"i", "image/png")}, "background")):
        with pytest.raises(APIError) as err:
            form_of(data, files)
        assert err.value.status == 400 and err.value.param == param, (param, err.value.message)
    with pytest.raises(APIError) as err:
        form_of({"prompt": "p", "model": "dall-e-2"}, {"image": ("a.png", b"i", "image/png")})
    assert err.value.status == 404 and err.value.code == "model_not_found"


def test_the_edit_fields_are_vllm_omnis_endpoint_s_own() -> None:
    """A coupling: the form fields omni-ext hands on are exactly those of vLLM-Omni's edit endpoint."""
    import inspect

    from vllm_omni.entrypoints.openai.api_server import edit_images

    from omni_ext.api.edits import VLLM_OMNI_FIELDS

    params = inspect.signature(edit_images).parameters
    names = {getattr(p.default, "alias", None) or n for n, p in params.items() if n != "raw_request"}
    assert {n.removesuffix("[]") for n in names} == VLLM_OMNI_FIELDS


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_bytes(side: int = 16) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


def _mp4_bytes() -> bytes:
    import imageio.v3 as iio
    import numpy as np

    return iio.imwrite("<bytes>", np.zeros((5, 32, 32, 3), dtype=np.uint8), extension=".mp4", fps=8)


def _wav_bytes() -> bytes:
    import io
    import wave

    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(8000), w.writeframes(b"\0\0" * 800)
    return buf.getvalue()


def test_json_references_reach_vllm_omnis_generation_call(tmp_path: Path) -> None:
    """``image_reference``, ``video_reference`` and ``audio_reference`` (JSON, as LiteLLM's hosted_vllm
    provider sends them) are decoded by vLLM-Omni's own decoders and reach its generation call as the
    reference image, video and audio, where they used to be accepted and dropped; the temporary files of
    the video and audio are gone once the generation ends, and one that does not decode is a 400."""
    import asyncio
    import os

    from omni_ext.api import videos
    from omni_ext.api.intake import with_image_references

    seen: dict = {}

    class Handler:
        stage_configs = None

        async def _run_and_extract(self, request, request_id, **kw):
            seen.update(kw, files=[p for p in (*kw["reference_video"].cleanup_paths, *kw["reference_audio"].cleanup_paths)
                                   if os.path.exists(p)])
            return "artifacts"

    class Admitted:
        def started(self) -> None:
            pass

    state = api_state(tmp_path / "i2v", ModelLimits("WanImageToVideoPipeline", 16, 1, True, image_input=True))
    body = Body({"prompt": "x", "image_reference": {"image_url": _data_url("image/png", _png_bytes())},
                 "video_reference": {"video_url": _data_url("video/mp4", _mp4_bytes())},
                 "audio_reference": {"audio_url": _data_url("audio/wav", _wav_bytes())}}, {})
    spec = asyncio.run(with_image_references(build_video_request(body, state, {}), state))
    assert spec.reference.size == (16, 16) and spec.request.image_reference is None
    assert asyncio.run(videos.generate(Handler(), spec, "r1", Admitted())) == "artifacts"
    assert seen["reference_image"].data.size == (16, 16)
    video, audio = seen["reference_video"], seen["reference_audio"]
    assert video is not None and audio is not None and len(seen["files"]) >= 1, seen
    assert not any(os.path.exists(p) for p in (*video.cleanup_paths, *audio.cleanup_paths))  # removed afterwards
    # a text-only model refuses an image reference; a video reference that is no video is a 400
    text_only = api_state(tmp_path / "t2v", ModelLimits("WanPipeline", 16, 1, True))
    with pytest.raises(APIError) as err:
        asyncio.run(with_image_references(build_video_request(body, text_only, {}), text_only))
    assert (err.value.code, err.value.param) == ("unsupported_parameter", "image_reference")
    bad = build_video_request(Body({"prompt": "x", "video_reference": {"video_url": "data:video/mp4;base64,AAAA"}}, {}),
                              text_only, {})
    with pytest.raises(APIError) as err:
        asyncio.run(videos.generate(Handler(), bad, "r2", Admitted()))
    assert err.value.status == 400 and err.value.code == "invalid_reference"


def test_image_requests_carry_lora_layers_and_system_prompt_as_vllm_omnis_route_does(tmp_path: Path) -> None:
    """``lora``, ``layers``, ``system_prompt``, ``use_system_prompt`` and ``bot_task`` reach the sampling
    params as vLLM-Omni's own single-stage route puts them there (they used to be refused with a 400);
    malformed ones get a 400 naming them."""
    from omni_ext.api.intake import build_image_request

    state = api_state(tmp_path / "q", ModelLimits("QwenImagePipeline", 16, 1, False))
    spec, _ = build_image_request({"prompt": "x", "size": "64x64", "lora": {"name": "style", "path": "/loras/style",
                                   "scale": 0.5}, "layers": 4, "system_prompt": "be brief", "use_system_prompt": True,
                                   "bot_task": "image"}, state)
    prompt, params = spec.request
    assert (params.lora_request.lora_name, params.lora_request.lora_path, params.lora_scale) == ("style", "/loras/style", 0.5)
    assert params.layers == 4
    assert {k: params.extra_args[k] for k in ("system_prompt", "use_system_prompt", "bot_task")} == {
        "system_prompt": "be brief", "use_system_prompt": True, "bot_task": "image"}
    assert prompt["mm_processor_kwargs"] == {"target_h": 64, "target_w": 64}
    for field, value in (("lora", {"name": "x"}), ("lora", "style"), ("layers", 0), ("layers", "4"),
                         ("system_prompt", 3), ("use_system_prompt", "yes")):
        with pytest.raises(APIError) as err:
            build_image_request({"prompt": "x", field: value}, state)
        assert err.value.param == field and err.value.status == 400, (field, value)


def test_prompts_are_bounded_before_any_work(tmp_path: Path) -> None:
    """A prompt, negative prompt or system prompt over MAX_PROMPT_CHARS is a 400 naming the field, on videos
    and images alike, before a job exists; the schemas say the same bound."""
    from omni_ext.api import schemas
    from omni_ext.api.intake import build_image_request
    from omni_ext.api.limits import MAX_PROMPT_CHARS

    video = api_state(tmp_path / "v", ModelLimits("WanPipeline", 16, 1, True))
    image = api_state(tmp_path / "i", ModelLimits("QwenImagePipeline", 16, 1, False))
    long = "x" * (MAX_PROMPT_CHARS + 1)
    for field in ("prompt", "negative_prompt"):
        body = {"prompt": "ok", field: long}
        with pytest.raises(APIError) as err:
            build_video_request(Body(body), video, {})
        assert (err.value.param, err.value.code) == (field, "string_above_max_length")
        with pytest.raises(APIError) as err:
            build_image_request(body, image)
        assert err.value.param == field
        assert schemas.VIDEO_CREATE["properties"][field]["maxLength"] == MAX_PROMPT_CHARS
        assert schemas.IMAGE_GENERATE["properties"][field]["maxLength"] == MAX_PROMPT_CHARS
    with pytest.raises(APIError) as err:
        build_image_request({"prompt": "ok", "system_prompt": long}, image)
    assert err.value.param == "system_prompt"
    build_video_request(Body({"prompt": "x" * MAX_PROMPT_CHARS}), video, {})  # at the bound: fine


def test_media_writes_are_fsynced_and_a_killed_writes_temp_file_is_removed_at_start(tmp_path: Path, monkeypatch) -> None:
    from omni_ext.api import media

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    media.write_atomic(tmp_path / "video_a.mp4", b"mp4")
    assert (tmp_path / "video_a.mp4").read_bytes() == b"mp4" and len(synced) == 2  # the file, then its directory
    (tmp_path / ".video_b.mp4.tmp").write_bytes(b"half")  # a process killed mid-write leaves this
    (tmp_path / "keep.tmp").write_bytes(b"not ours")
    assert media.remove_orphans(tmp_path) == [".video_b.mp4.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.tmp", "video_a.mp4"]
    assert media.remove_orphans(tmp_path / "missing") == []


# ---- vLLM-Omni's multipart uploads: input_references, control_reference, latent-mask editing ----------------
class _Stop(Exception):
    """Raised where vLLM-Omni's generation call would reach the engine."""


def _probe_handler(pipeline: str):
    """vLLM-Omni's own video handler, for a served ``pipeline`` (its capabilities come from vLLM-Omni's
    metadata), whose engine call records the engine inputs instead: the prompt and sampling params, each
    temporary file as ``("file", suffix, its bytes)`` read while the engine would run, each image as
    ``("image", size, pixels)``."""
    import tempfile

    from PIL import Image
    from vllm_omni.entrypoints.openai.serving_video import OmniOpenAIServingVideo

    def norm(value):
        if isinstance(value, Image.Image):
            return "image", value.size, value.tobytes()
        if isinstance(value, str) and value.startswith(tempfile.gettempdir()):
            return "file", Path(value).suffix, Path(value).read_bytes()
        if isinstance(value, (list, tuple)):
            return [norm(v) for v in value]
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items()}
        return value

    class Probe(OmniOpenAIServingVideo):
        async def _run_generation(self, prompt, gen_params, request_id, *, on_started=None):
            self.seen = norm(dict(prompt)), norm(vars(gen_params))
            raise _Stop

    od_config = SimpleNamespace(model_class_name=pipeline, model=None, revision=None)
    return Probe(SimpleNamespace(get_diffusion_od_config=lambda: od_config), model_name="m")


def _upload_file(part: tuple[str, str, bytes]):
    import io

    from starlette.datastructures import Headers, UploadFile

    return UploadFile(io.BytesIO(part[2]), size=len(part[2]), filename=part[0],
                      headers=Headers({"content-type": part[1]}))


async def _stock_engine_inputs(handler, form: dict, files: dict):
    """What vLLM-Omni's own ``/v1/videos`` form (``_parse_video_form``) and generation call make of a request."""
    import inspect

    from vllm_omni.entrypoints.openai.video.generation.helpers import _cleanup_video_references, _parse_video_form

    kwargs = {name: getattr(p.default, "default", p.default)
              for name, p in inspect.signature(_parse_video_form).parameters.items() if name != "raw_request"}
    kwargs.update(form)
    for name, parts in files.items():
        kwargs[name] = [_upload_file(p) for p in parts] if name == "input_references" else _upload_file(parts[-1])
    app_state = SimpleNamespace(openai_serving_video=handler, openai_serving_models=None, stage_configs=None)
    request, handler, _, image, video, audio, control, edit = await _parse_video_form(
        SimpleNamespace(app=SimpleNamespace(state=app_state)), **kwargs)
    try:
        await handler._run_and_extract(request, "stock", reference_image=image, reference_video=video,
                                       reference_audio=audio, latent_edit_input=edit)
    except _Stop:
        pass
    finally:
        _cleanup_video_references(video, audio, control, edit)
    return handler.seen


async def _our_engine_inputs(handler, state, form: dict, files: dict):
    """What omni-ext's ``/v1/videos`` (intake, then its generation) makes of the same request."""
    from omni_ext.api import videos
    from omni_ext.api.intake import with_image_references, with_uploads

    body = Body(dict(form), {k: v[-1] for k, v in files.items()}, {k: list(v) for k, v in files.items()})
    spec = await with_uploads(await with_image_references(build_video_request(body, state, {}), state), body, handler)
    with pytest.raises(_Stop):
        await videos.generate(handler, spec, "ours", SimpleNamespace(started=lambda: None))
    return handler.seen


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary directory vLLM-Omni's helpers persist uploads in, for this test alone."""
    import tempfile

    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def _left(temp_dir: Path) -> list[str]:
    """The upload files vLLM-Omni's helpers persisted that are still there."""
    return [p.name for p in temp_dir.iterdir() if p.name.startswith("vllm_omni_")]


def _mask(value) -> tuple[str, str, bytes]:
    return "mask.json", "application/json", json.dumps(value).encode()


UPLOADS = {
    "two reference images": ("WanPipeline", {}, {"input_references": [("a.png", "image/png", _png_bytes()),
                                                                      ("b.png", "image/png", _png_bytes(8))]}),
    "mixed references": ("MiniMaxH3Pipeline", {}, {"input_references": [
        ("a.png", "image/png", _png_bytes()), ("b.png", "image/png", _png_bytes(8)),
        ("c.mp4", "video/mp4", b"mp4 bytes"), ("d.wav", "audio/wav", b"wav bytes")]}),
    "references and audio_reference": ("MiniMaxH3Pipeline", {"audio_reference": {"audio_url": "AUDIO"}},
                                       {"input_references": [("d.wav", "audio/wav", b"wav bytes")]}),
    "control": ("Cosmos3OmniPipeline", {"control_type": " Edge ", "extra_params": {"edge": {"control_weight": 0.5}}},
                {"control_reference": [("edge.png", "image/png", _png_bytes())]}),
    "latent edit": ("MiniMaxH3Pipeline", {}, {"source_video": [("src.mp4", "video/mp4", b"source video")],
                                              "source_audio": [("src.wav", "audio/wav", b"source audio")],
                                              "video_noise_mask": [_mask([[0, 1], [1, 0]])],
                                              "audio_noise_mask": [_mask({"ranges": [[0, 0.5]]})]}),
    "mask alone": ("MiniMaxH3ModularPipeline", {}, {"video_noise_mask": [_mask([1, 0, 1])]}),
}


@pytest.mark.parametrize("case", UPLOADS)
def test_uploads_reach_the_engine_as_vllm_omnis_route_makes_them(tmp_path: Path, temp_dir: Path, case: str) -> None:
    """``input_references``, ``control_reference`` + ``control_type`` and the latent-edit uploads (refused with
    a 400 before) become exactly the engine inputs vLLM-Omni's own route makes of them (prompt, multi_modal_data,
    sampling params and their extra_args, each file's bytes while the engine runs), for the models vLLM-Omni
    takes them for; every temporary file is gone afterwards."""
    pipeline, form, files = UPLOADS[case]
    form = {"prompt": "x", "num_frames": 5, "seed": 3, **form}
    if "audio_reference" in form:
        form["audio_reference"] = {"audio_url": _data_url("audio/wav", _wav_bytes())}
    stock_form = {k: json.dumps(v) if isinstance(v, dict) else v for k, v in form.items()}  # a form's JSON strings
    handler = _probe_handler(pipeline)
    state = api_state(tmp_path / "s", ModelLimits(pipeline, 16, 1, True))
    try:
        stock = asyncio.run(_stock_engine_inputs(handler, stock_form, files))
        assert not _left(temp_dir)
        ours = asyncio.run(_our_engine_inputs(handler, state, form, files))
    finally:
        handler.shutdown()
    assert ours == stock
    prompt, params = ours
    if case == "control":
        assert params["extra_args"]["edge"] == {"control_weight": 0.5, "control_path": ("file", ".png", _png_bytes())}
    else:
        assert prompt["multi_modal_data"], prompt
    assert not _left(temp_dir)  # removed once the generation ended (here: failed)


REFUSED = [  # (pipeline, form, files, param, code): vLLM-Omni's own route refuses each with the same 400
    ("WanPipeline", {"control_type": "edge"}, {"control_reference": [("e.png", "image/png", _png_bytes())]},
     "control_type", "unsupported_parameter"),
    ("Cosmos3OmniPipeline", {"control_type": "edge"}, {}, "control_reference", "invalid_value"),
    ("Cosmos3OmniPipeline", {}, {"control_reference": [("e.png", "image/png", _png_bytes())]}, "control_type",
     "invalid_value"),
    ("Cosmos3OmniPipeline", {"control_type": "edge", "extra_params": {"edge": {"control_path": "/x.mp4"}}},
     {"control_reference": [("e.png", "image/png", _png_bytes())]}, "extra_params", "invalid_value"),
    ("Cosmos3OmniPipeline", {"control_type": "edge"}, {"control_reference": [("e.wav", "audio/wav", b"x")]},
     "control_reference", "invalid_value"),
    ("WanPipeline", {}, {"video_noise_mask": [_mask([1])]}, "video_noise_mask", "unsupported_parameter"),
    ("MiniMaxH3Pipeline", {}, {"source_video": [("s.mp4", "video/mp4", b"v")]}, "source_video", "invalid_value"),
    ("MiniMaxH3Pipeline", {}, {"source_audio": [("s.wav", "audio/wav", b"a")], "video_noise_mask": [_mask([1])]},
     "source_audio", "invalid_value"),
    ("MiniMaxH3Pipeline", {}, {"source_video": [("s.avi", "video/x-msvideo", b"v")],
                               "video_noise_mask": [_mask([1])]}, "source_video", "invalid_value"),
    ("MiniMaxH3Pipeline", {}, {"video_noise_mask": [("m.json", "application/json", b"{not json")]},
     "video_noise_mask", "invalid_value"),
    ("MiniMaxH3Pipeline", {}, {"audio_noise_mask": [("m.json", "application/json", b"")]}, "audio_noise_mask",
     "invalid_value"),
    ("MiniMaxH3Pipeline", {}, {"input_references": [("a.gif", "image/gif", b"GIF89a")]}, "input_references",
     "invalid_value"),
    ("WanPipeline", {"image_reference": {"image_url": "data:image/png;base64,AAAA"}},
     {"input_references": [("a.png", "image/png", _png_bytes())]}, "input_references", "invalid_value"),
    ("WanPipeline", {}, {"input_references": [("a.png", "image/png", _png_bytes())],
                         "input_reference": [("b.png", "image/png", _png_bytes())]},
     "input_references", "invalid_value"),
]


@pytest.mark.parametrize("pipeline,form,files,param,code", REFUSED,
                         ids=[f"{r[0]}-{r[3]}-{i}" for i, r in enumerate(REFUSED)])
def test_uploads_are_refused_where_vllm_omnis_route_refuses_them(tmp_path: Path, temp_dir: Path, pipeline, form,
                                                                 files, param, code) -> None:
    """Where a field only makes sense for some models (or lacks its partner), omni-ext answers vLLM-Omni's own
    status and message, as an OpenAI-style error naming the field, before a job exists; nothing is left behind."""
    from fastapi import HTTPException

    from omni_ext.api.intake import with_image_references, with_uploads

    handler = _probe_handler(pipeline)
    state = api_state(tmp_path / "s", ModelLimits(pipeline, 16, 1, True, image_input=True))
    stock_form = {"prompt": "x", **{k: json.dumps(v) if isinstance(v, dict) else v for k, v in form.items()}}
    try:
        with pytest.raises(HTTPException) as stock:
            asyncio.run(_stock_engine_inputs(handler, stock_form, files))

        async def ours() -> None:
            body = Body({"prompt": "x", **form}, {k: v[-1] for k, v in files.items()}, {k: list(v) for k, v in files.items()})
            spec = build_video_request(body, state, {})
            await with_uploads(await with_image_references(spec, state), body, handler)

        with pytest.raises(APIError) as err:
            asyncio.run(ours())
    finally:
        handler.shutdown()
    assert (err.value.status, err.value.message) == (stock.value.status_code, stock.value.detail)
    assert (err.value.param, err.value.code) == (param, code)
    assert err.value.body()["error"]["type"] == "invalid_request_error"
    assert not _left(temp_dir)


def test_uploads_keep_the_reference_bounds_and_a_late_refusal_leaves_no_file(tmp_path: Path, temp_dir: Path,
                                                                           monkeypatch) -> None:
    """An uploaded image (``input_references``, ``control_reference``) is held to the reference images' pixel
    bound from its header, as ``input_reference`` is; a refusal after some uploads were persisted removes them;
    without a video handler to ask, no model capability is assumed."""
    from omni_ext.api import intake
    from omni_ext.api.intake import with_uploads

    monkeypatch.setattr(intake, "max_reference_pixels", lambda: 15 * 15)
    state = api_state(tmp_path / "s", ModelLimits("Cosmos3OmniPipeline", 16, 1, True))
    handler = _probe_handler("Cosmos3OmniPipeline")

    def run(form: dict, files: dict, with_handler=handler):
        body = Body({"prompt": "x", **form}, {k: v[-1] for k, v in files.items()}, {k: list(v) for k, v in files.items()})
        return asyncio.run(with_uploads(build_video_request(body, state, {}), body, with_handler))

    try:
        for name in ("input_references", "control_reference"):
            with pytest.raises(APIError) as err:
                run({"control_type": "edge"} if name == "control_reference" else {},
                    {name: [("a.png", "image/png", _png_bytes(16))]})
            assert (err.value.param, err.value.code) == (name, "image_too_large") and "16x16" in err.value.message
        spec = run({}, {"input_references": [("a.png", "image/png", _png_bytes(15)), ("v.mp4", "video/mp4", b"v")]})
        assert len(_left(temp_dir)) == 2 and spec.uploads.video.data == list(spec.uploads.video.cleanup_paths)
        spec.uploads.cleanup()
        spec.uploads.cleanup()  # again: nothing more to do
        assert not _left(temp_dir)
        with pytest.raises(APIError) as err:  # the control upload is refused after the references were persisted
            run({"control_type": "edge"}, {"input_references": [("v.mp4", "video/mp4", b"v")],
                                           "control_reference": [("c.png", "image/png", b"")]})
        assert err.value.message == "control_reference must not be empty." and not _left(temp_dir)
        with pytest.raises(APIError) as err:
            run({"control_type": "edge"}, {"control_reference": [("c.png", "image/png", _png_bytes(8))]}, None)
        assert err.value.code == "unsupported_parameter" and "Supported control upload types: none" in err.value.message
    finally:
        handler.shutdown()


def test_repeated_and_bracketed_file_parts_are_all_kept(tmp_path: Path) -> None:
    """``input_references`` is one file field sent several times (also as an SDK's ``input_references[]``):
    the form parser keeps every part, in order; a single-file field keeps its last part, as vLLM-Omni's form does."""
    import requests as rq
    from starlette.requests import Request

    from omni_ext.api.intake import parse_body

    files = [("input_references", ("a.png", b"A", "image/png")), ("input_references[]", ("b.png", b"B", "image/png")),
             ("input_reference", ("c.png", b"C", "image/png")), ("input_reference", ("d.png", b"D", "image/png"))]
    prepared = rq.Request("POST", "http://x/v1/videos", data={"prompt": "p"}, files=files).prepare()
    scope = {"type": "http", "method": "POST", "path": "/v1/videos", "query_string": b"",
             "headers": [(b"content-type", prepared.headers["Content-Type"].encode()),
                         (b"content-length", str(len(prepared.body)).encode())]}
    sent = [{"type": "http.request", "body": prepared.body, "more_body": False}]

    async def receive():
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    body = asyncio.run(parse_body(Request(scope, receive), 2**20))
    assert [p[0] for p in body.parts("input_references")] == ["a.png", "b.png"]
    assert body.files["input_reference"][2] == b"D" and [p[2] for p in body.parts("input_reference")] == [b"C", b"D"]
    assert Body({}, {"x": ("x", "t", b"1")}).parts("x") == [("x", "t", b"1")] and Body({}).parts("x") == []


def test_the_routes_remove_the_uploads_however_the_job_ends(tmp_path: Path, temp_dir: Path) -> None:
    """On omni-ext's routes (in-process, vLLM-Omni's handler with its engine call failing): the sync request and
    the async job both hand the references to the generation call and leave no file behind when it fails; a
    request refused before it runs leaves none either."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from omni_ext.api.routes import build_router
    from omni_ext.api.state import VideoBackend

    state = api_state(tmp_path / "s", ModelLimits("WanPipeline", 16, 1, True))
    handler = _probe_handler("WanPipeline")
    state.video = VideoBackend(handler=handler, defaults={})
    app = FastAPI()
    app.include_router(build_router())
    app.state.omni_ext = state
    files = [("prompt", (None, "x")), ("num_frames", (None, "5")), ("size", (None, "32x32")),
             ("input_references", ("a.png", _png_bytes(), "image/png")),
             ("input_references", ("b.png", _png_bytes(8), "image/png"))]
    try:
        with TestClient(app) as client:
            sync = client.post("/v1/videos/sync", files=files)
            assert (sync.status_code, sync.json()["error"]["code"]) == (500, "generation_failed")
            assert [v[:2] for v in handler.seen[0]["multi_modal_data"]["video"]] == [("file", ".mp4")] * 2
            assert not _left(temp_dir)
            handler.seen = None
            created = client.post("/v1/videos", files=files)
            assert created.status_code == 200, created.text
            deadline = time.monotonic() + 30
            while (job := client.get(f"/v1/videos/{created.json()['id']}").json())["status"] != "failed":
                assert time.monotonic() < deadline, job
                time.sleep(0.05)
            assert handler.seen is not None and not _left(temp_dir)
            refused = client.post("/v1/videos", files=[*files, ("control_type", (None, "edge"))])
            assert refused.json()["error"]["param"] == "control_reference" and not _left(temp_dir)
    finally:
        handler.shutdown()


def test_multi_stage_image_generation_goes_to_vllm_omnis_own_route() -> None:
    """vLLM-Omni builds a multi-stage model's image request through its chat handler (``len(stage_configs)
    > 1``); omni-ext's single-stage call cannot run it, so the dispatch hands it to vLLM-Omni's route. A
    one-stage model stays on omni-ext's route (here: its 503 before start-up)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from starlette.responses import JSONResponse as StarletteJSON

    from omni_ext.api.routes import build_router

    seen: list[str] = []

    async def stock(scope, receive, send):
        seen.append(scope["path"])
        await StarletteJSON({"stock": True})(scope, receive, send)

    app = FastAPI()
    app.include_router(build_router(None, stock))
    client = TestClient(app)
    app.state.stage_configs = ["ar", "diffusion"]
    resp = client.post("/v1/images/generations", json={"prompt": "a cat"})
    assert resp.json() == {"stock": True} and seen == ["/v1/images/generations"]
    app.state.stage_configs = ["diffusion"]
    resp = client.post("/v1/images/generations", json={"prompt": "a cat"})
    assert resp.status_code == 503 and "error" in resp.json() and seen == ["/v1/images/generations"]
    schema = app.openapi()["paths"]["/v1/images/generations"]["post"]  # omni-ext's documented route stays
    assert schema["requestBody"]


def test_a_video_input_reference_is_decoded_as_vllm_omnis_route_decodes_it(tmp_path: Path) -> None:
    """vLLM-Omni's ``/v1/videos`` takes a video file as ``input_reference`` (no image: its decoder tries a
    video); omni-ext carries it to the generation call as the reference video, decoded by the same decoder,
    instead of a 400. Bytes that are neither stay a 400 ``invalid_image``, before any job exists."""
    import asyncio

    from omni_ext.api import videos
    from omni_ext.api.intake import is_video_container

    seen: dict = {}

    class Handler:
        stage_configs = None

        async def _run_and_extract(self, request, request_id, **kw):
            seen.update(kw)
            return "artifacts"

    class Admitted:
        def started(self) -> None:
            pass

    mp4 = _mp4_bytes()
    assert is_video_container(mp4) and not is_video_container(_png_bytes()) and not is_video_container(b"not a video")
    state = api_state(tmp_path / "v2v", ModelLimits("WanVACEPipeline", 16, 1, True, image_input=True))
    spec = build_video_request(Body({"prompt": "x"}, {"input_reference": ("a.mp4", "video/mp4", mp4)}), state, {})
    assert spec.reference is None and spec.reference_video == mp4
    assert asyncio.run(videos.generate(Handler(), spec, "r1", Admitted())) == "artifacts"
    assert seen.get("reference_image") is None and seen["reference_video"] is not None
    with pytest.raises(APIError) as err:
        build_video_request(Body({"prompt": "x"}, {"input_reference": ("a.png", "image/png", b"not an image")}), state, {})
    assert (err.value.status, err.value.code, err.value.param) == (400, "invalid_image", "input_reference")


def test_a_kept_request_reads_back_whole_and_a_half_written_one_is_dropped(tmp_path: Path) -> None:
    from omni_ext.api.archive import RequestArchive
    from omni_ext.api.intake import Body

    png, other = b"\x89PNG-one", b"\x89PNG-two"
    body = Body(fields={"prompt": "a fox", "seed": 5, "extra": {"a": [1, 2]}},
                files={"input_reference": ("r.png", "image/png", png), "input_references": ("b.png", "image/png", other)},
                file_lists={"input_references": [("a.png", "image/png", png), ("b.png", "image/png", other)]})
    archive = RequestArchive(tmp_path / "requests")
    archive.save("video_1", body)
    back = archive.load("video_1")
    assert back.fields == body.fields and back.files == body.files
    assert back.parts("input_references") == body.parts("input_references") and back.parts("input_reference") == [body.files["input_reference"]]
    assert archive.ids() == {"video_1"}
    (tmp_path / "requests" / "video_2").mkdir()  # a save killed before its manifest
    (tmp_path / "requests" / "video_2" / "0.bin").write_bytes(b"x")
    assert archive.load("video_2") is None and archive.load("video_3") is None
    archive.remove("video_1")
    assert archive.load("video_1") is None and archive.ids() == {"video_2"}


def test_interrupted_queued_jobs_with_a_kept_request_stay_queued(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "j.sqlite")
    for i, status in enumerate(["queued", "queued", "in_progress"]):
        store.add(Job(id=f"video_{i}", kind="video", status=status))
    assert store.fail_interrupted(now=7, kept={"video_0", "video_2"}) == ["video_1", "video_2"]
    assert [j.id for j in store.queued("video")] == ["video_0"]
    assert store.get("video_2").error_code == "server_restarted"  # it was running: never run twice


def test_prompts_are_bounded_in_the_served_models_tokens_where_its_tokenizer_is_at_hand(tmp_path: Path) -> None:
    """With the model's fast tokenizer on disk (the tiny Wan's T5 one, saved as a model folder's
    ``tokenizer/``), a prompt over MAX_PROMPT_TOKENS tokens, though within the character bound, is a 400
    naming the field and its count, before a job exists; at the bound it passes; without a tokenizer
    folder only characters are bounded."""
    from omni_ext.api import tokens
    from omni_ext.api.limits import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS
    from omni_ext.models.tiny import build_t5_tokenizer

    build_t5_tokenizer().save_pretrained(str(tmp_path / "model" / "tokenizer"))
    counter = tokens.load(str(tmp_path / "model"))
    assert counter is not None and counter.count("a cat") == 2 and tokens.load(str(tmp_path)) is None
    video = api_state(tmp_path / "v", ModelLimits("WanPipeline", 16, 1, True), prompt_tokens=counter)
    fits = " ".join(["a"] * MAX_PROMPT_TOKENS)
    over = fits + " a"
    assert len(over) < MAX_PROMPT_CHARS and counter.count(over) == MAX_PROMPT_TOKENS + 1
    for field in ("prompt", "negative_prompt"):
        with pytest.raises(APIError) as err:
            build_video_request(Body({"prompt": "ok", field: over}), video, {})
        assert (err.value.status, err.value.param, err.value.code) == (400, field, "string_above_max_length")
        assert f"is {MAX_PROMPT_TOKENS + 1} tokens" in err.value.message
    build_video_request(Body({"prompt": fits}), video, {})  # at the bound: fine


def test_every_served_name_is_accepted_in_model_and_others_are_404(tmp_path: Path) -> None:
    """``--served-model-name wan2.1 sora-2``: both names (and the path, and none) are the served model;
    any other name is a 404 ``model_not_found``, before a job exists."""
    from omni_ext.api.intake import build_image_request

    video = api_state(tmp_path / "v", ModelLimits("WanPipeline", 16, 1, True), model_aliases=("sora-2",))
    image = api_state(tmp_path / "i", ModelLimits("QwenImagePipeline", 16, 1, False), model_aliases=("gpt-image-1",))
    for model in (None, "m", "sora-2"):
        build_video_request(Body({"prompt": "x", **({"model": model} if model else {})}), video, {})
    build_image_request({"prompt": "x", "model": "gpt-image-1"}, image)
    for _state, build in ((video, lambda f: build_video_request(Body(f), video, {})),
                         (image, lambda f: build_image_request(f, image))):
        with pytest.raises(APIError) as err:
            build({"prompt": "x", "model": "dall-e-3"})
        assert (err.value.status, err.value.code, err.value.param) == (404, "model_not_found", "model")


def test_errors_tell_the_sdk_whether_a_retry_helps() -> None:
    """``x-should-retry``: false for a client's mistake and for a generation the same request fails again
    (the SDK would otherwise run it three times), true with Retry-After where waiting helps."""
    from omni_ext.api.errors import bad_request, retry_headers, too_busy

    def header(err: APIError) -> str | None:
        return err.response().headers.get("x-should-retry")

    assert header(bad_request("no", "size")) == "false"
    assert header(APIError(404, "gone", code="model_not_found")) == "false"
    assert header(APIError(500, "boom", code="generation_failed")) == "false"
    assert header(APIError(507, "full", code="storage_full")) == "false"
    busy = too_busy("full", 2.5).response()
    assert busy.headers["x-should-retry"] == "true" and busy.headers["retry-after"] == "3"
    assert header(APIError(503, "respawning", code="respawning", headers=retry_headers(4))) == "true"
    assert header(APIError(503, "lost", code="replica_lost")) == "true"
    assert header(APIError(409, "not ready", code="video_not_ready")) is None  # the SDK's own rule
    assert header(APIError(500, "disk", code="storage_error")) is None


def test_openai_image_hints_are_applied_refused_or_reported_never_silently_dropped(tmp_path: Path) -> None:
    """``quality`` is a fraction of the family's native steps (Qwen-Image: 50), unless the request sets its
    steps; ``background="transparent"`` is refused; ``style``/``moderation`` are reported as not applied;
    ``safety_identifier`` (or ``user``) is recorded; bad values are a 400 naming the field."""
    from omni_ext.api.intake import build_image_request, hints

    qwen = ModelLimits("QwenImagePipeline", 16, 2, False)
    assert hints({"quality": "low"}, qwen, None) == (12, (), None)
    assert hints({"quality": "high", "style": "vivid"}, qwen, None) == (50, ("style",), None)
    assert hints({"quality": "low"}, qwen, 7) == (7, ("quality",), None)  # the request's own steps win
    assert hints({"quality": "medium"}, ModelLimits("SomeNewPipeline", 16, 1, False), None) == (None, ("quality",), None)
    assert hints({"quality": "auto", "background": "opaque", "user": "u1", "safety_identifier": "s1"}, qwen, None) == \
        (None, (), "s1")
    image = api_state(tmp_path / "i", qwen)
    spec, reply = build_image_request({"prompt": "x", "quality": "medium", "moderation": "low", "user": "u7"}, image)
    assert spec.steps == 25 and spec.request[1].num_inference_steps == 25
    assert reply.ignored == ("moderation",) and reply.end_user == "u7"
    for field, value in (("background", "transparent"), ("background", "glass"), ("quality", "ultra"),
                         ("style", "noir"), ("moderation", "none"), ("safety_identifier", "x" * 257), ("user", 3)):
        with pytest.raises(APIError) as err:
            build_image_request({"prompt": "x", field: value}, image)
        assert (err.value.status, err.value.param) == (400, field), (field, value)
    assert schemas.IMAGE_GENERATE["properties"]["safety_identifier"]["maxLength"] == limits.MAX_USER_CHARS


def test_a_video_job_makes_one_video(tmp_path: Path) -> None:
    video = api_state(tmp_path / "v", ModelLimits("WanPipeline", 16, 1, True))
    build_video_request(Body({"prompt": "x", "num_outputs_per_prompt": 1}), video, {})
    with pytest.raises(APIError) as err:
        build_video_request(Body({"prompt": "x", "num_outputs_per_prompt": 2}), video, {})
    assert (err.value.param, err.value.code) == ("num_outputs_per_prompt", "unsupported_parameter")


def test_a_spritesheet_is_evenly_spaced_frames_in_a_grid() -> None:
    """17 frames (frame i a flat grey of level 15*i), 48x32: 8 tiles in two rows of 4, the first tile frame
    0 and the last frame 16, the ones between evenly spaced; a 3-frame video is one row of 3."""
    import io

    import av
    import numpy as np
    from PIL import Image

    def mp4(n: int) -> bytes:
        buf = io.BytesIO()
        with av.open(buf, "w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=16)
            stream.width, stream.height, stream.pix_fmt = 48, 32, "yuv420p"
            stream.options = {"crf": "0"}
            for i in range(n):
                frame = av.VideoFrame.from_ndarray(np.full((32, 48, 3), 15 * i, np.uint8), format="rgb24")
                out.mux(stream.encode(frame))
            out.mux(stream.encode())
        return buf.getvalue()

    sheet = Image.open(io.BytesIO(media.mp4_spritesheet(mp4(17))))
    assert sheet.format == "JPEG" and sheet.size == (4 * 48, 2 * 32)
    grid = np.asarray(sheet.convert("L"), dtype=float)
    levels = [grid[r * 32 + 8:r * 32 + 24, c * 48 + 8:c * 48 + 40].mean() for r in range(2) for c in range(4)]
    expected = [15 * round(i * 16 / 7) for i in range(8)]
    assert all(abs(a - b) < 6 for a, b in zip(levels, expected)), (levels, expected)
    assert Image.open(io.BytesIO(media.mp4_spritesheet(mp4(3)))).size == (3 * 48, 32)


def test_a_job_keeps_what_a_remix_needs_and_only_that() -> None:
    """A remix reruns the source's fields and seed with a new prompt: a job keeps its request's fields
    (not its prompt); not a request with uploads or media references, whose bytes do not outlive the job."""
    from omni_ext.api.intake import remix_fields

    assert remix_fields(Body({"prompt": "p", "size": "32x32", "seed": 5})) == {"size": "32x32", "seed": 5}
    assert remix_fields(Body({"prompt": "p"}, files={"input_reference": ("a.png", "image/png", b"x")})) is None
    assert remix_fields(Body({"prompt": "p", "image_reference": {"image_url": "data:image/png;base64,AAAA"}})) is None
    assert remix_fields(Body({"prompt": "p", "extra_params": {"x": "y" * 20000}})) is None  # too large to keep


def test_public_url_is_an_absolute_http_url_without_query() -> None:
    from omni_ext.api.settings import public_url

    assert public_url("https://gen.example.com/omni/") == "https://gen.example.com/omni"
    assert public_url(None) is None and public_url("") is None
    for bad in ("gen.example.com", "ftp://x", "https://x/?a=1", "https://x/#f", 3):
        with pytest.raises(ValueError):
            public_url(bad)
    settings = load_settings(SimpleNamespace(port=1, additional_config='{"omni_ext": {"api": {"public_url": "http://p:9"}}}'),
                             {"OMNI_EXT_API_DATA_DIR": "/tmp/x"})
    assert settings.public_url == "http://p:9"


def test_the_openapi_schema_lists_exactly_what_the_parsers_accept() -> None:
    """Every field the video and image parsers accept is in the route's OpenAPI schema and nothing else
    (vLLM-Omni's own video fields come from its pydantic model); the page generated from the schema,
    ``docs/reference/api-fields.md``, is checked in ``tests/test_reference_docs.py``."""
    from omni_ext.api import intake

    video = set(intake._video_request_fields()) | intake._VIDEO_OWN_FIELDS | set(intake.UPLOAD_FIELDS)
    assert set(schemas.VIDEO_CREATE["properties"]) == video
    assert set(schemas.IMAGE_GENERATE["properties"]) == intake._IMAGE_FIELDS
    assert set(schemas.VIDEO_REMIX["properties"]) == {"prompt"}


def test_signed_links_open_one_image_until_they_expire(tmp_path: Path) -> None:
    """``omni_ext.api.signed``: the secret is made once (0600) and kept across restarts; a link's
    signature covers its path and expiry; only an image's content path can be signed."""
    import stat

    from omni_ext.api import signed

    secret = signed.load_secret(tmp_path)
    assert len(secret) == 32 and signed.load_secret(tmp_path) == secret  # a restart keeps the links working
    assert stat.S_IMODE((tmp_path / signed.KEY_FILE).stat().st_mode) == 0o600
    path = "/v1/images/img_" + "a" * 32 + "/content"
    query = signed.link_query(secret, path, now=1000.0, ttl_s=60)
    assert signed.verify(secret, path, query, now=1059.0)
    assert not signed.verify(secret, path, query, now=1061.0)  # expired
    assert not signed.verify(signed.load_secret(tmp_path / "other"), path, query, now=1000.0)  # another server's
    assert not signed.verify(secret, path.replace("a" * 32, "b" * 32), query, now=1000.0)  # another image
    assert not signed.verify(secret, path, query.replace("expires=1060", "expires=9999"), now=1000.0)
    assert not signed.verify(None, path, query, now=1000.0)  # signing off
    other = "/v1/videos/video_" + "a" * 32 + "/content"
    assert not signed.verify(secret, other, signed.link_query(secret, other, 1000.0, 60), now=1000.0)
    for bad in ("", "expires=abc&signature=00", "signature=" + "0" * 64):
        assert not signed.verify(secret, path, bad, now=1000.0)
    settings = load_settings(SimpleNamespace(port=1, additional_config='{"omni_ext": {"api": {"signed_url_ttl_s": 600}}}'),
                             {"OMNI_EXT_API_DATA_DIR": str(tmp_path)})
    assert settings.signed_url_ttl_s == 600
    assert load_settings(SimpleNamespace(port=1), {"OMNI_EXT_API_DATA_DIR": str(tmp_path)}).signed_url_ttl_s == 0
    with pytest.raises(ValueError, match="signed_url_ttl_s"):
        load_settings(SimpleNamespace(port=1), {"OMNI_EXT_API_DATA_DIR": str(tmp_path), "OMNI_EXT_API_SIGNED_URL_TTL_S": "-1"})
