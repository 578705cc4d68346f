"""The playground page (``/playground``, :mod:`omni_ext.api.playground`) in a real browser.

Debian's ``chromium`` (installed by ``scripts/setup.sh``), driven headless by Playwright, against
real servers of the shared pool: ``wan-api`` (tiny Wan, ``--api-key``), ``qwen`` (tiny Qwen-Image,
no key) and ``wan-sched`` (a 3 s admission bound, for a 429). Every test saves a screenshot of each
of its tabs under ``out/playground/`` (git-ignored, like the benchmarks' outputs; the path is printed).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import requests

from omni_ext.api.playground import CSP, size_choices
from omni_ext.api.validation import limits_for_model

KEY = "sk-omni-ext-test"  # conftest.SERVERS["wan-api"]
XSS = "<img src=x onerror=alert(1)>"
CHROMIUM = os.environ.get("OMNI_EXT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


# ---- pure -----------------------------------------------------------------------------------------
def test_size_choices_start_native_and_respect_the_spatial_multiple() -> None:
    sizes = size_choices(832, 480, 16)
    assert sizes[:2] == ["832x480", "480x832"] and "416x240" in sizes and "32x32" in sizes
    assert len(sizes) == len(set(sizes))
    for s in sizes:
        w, h = map(int, s.split("x"))
        assert w % 16 == 0 and h % 16 == 0 and w >= 16 and h >= 16
    assert size_choices(1328, 1328, 0)[0] == "1328x1328"  # unknown multiple: 16 assumed


def test_queue_summary_counts_running_and_queued_and_predicts_a_new_jobs_wait() -> None:
    from omni_ext.progress import StepProgress
    from tests.helpers import SHAPE, fake_queue

    queue, clock, files = fake_queue(slots=1, max_wait_s=10)  # 1 s per job, one slot
    assert queue.summary() == {"running": 0, "queued": 0, "slots": 1, "predicted_wait_s": 0.0}
    for name in "abc":
        queue.admit(name, 0, SHAPE)
    files["a"] = StepProgress(0, 4, t_start=clock.t, t_last=clock.t, mode="single")
    clock.t += 0.5
    # a has 0.5 s left, then b and c run 1 s each: a new job starts in 2.5 s
    assert queue.summary() == {"running": 1, "queued": 2, "slots": 1, "predicted_wait_s": 2.5}
    unknown, _, _ = fake_queue(seed=None)
    unknown.admit("x", 0, SHAPE)
    assert unknown.summary()["predicted_wait_s"] is None  # no rate known yet: no guess


# ---- browser fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    if not CHROMIUM:
        pytest.skip("no chromium on this machine: scripts/setup.sh installs Debian's package when it runs as root "
                    "(apt-get install chromium), or set OMNI_EXT_CHROMIUM to a Chromium binary")
    with sync_api.sync_playwright() as pw:
        # --no-sandbox: the suite runs as root in CI containers, where Chromium's sandbox cannot start.
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots() -> Path:
    path = Path(__file__).resolve().parents[1] / "out" / "playground"
    path.mkdir(parents=True, exist_ok=True)
    return path


class Tab:
    """One browser tab on a server's playground, with what it saw: dialogs, console errors, requests."""

    def __init__(self, browser, server, shots: Path, name: str, **context) -> None:
        self.ctx = browser.new_context(**context)
        self.page = self.ctx.new_page()
        self.page.set_default_timeout(60_000)
        self.server, self.shots, self.name = server, shots, name
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.posts: list[tuple[int, str | None]] = []  # (status, retry-after) of each POST answer
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        # Script errors; the browser's own "Failed to load resource" lines for 401/429 answers are expected.
        self.page.on("console", lambda m: m.type == "error" and not m.text.startswith("Failed to load resource")
                     and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("response", lambda r: r.request.method == "POST"
                     and self.posts.append((r.status, r.headers.get("retry-after"))))
        self.page.goto(server.url + "/")  # redirects to /playground

    def login(self, key: str) -> None:
        self.page.fill("#api-key", key)
        self.page.click("#key-save")

    def ready(self) -> None:
        self.page.wait_for_function("() => document.querySelector('#size').options.length > 0")

    def fill(self, **fields: str) -> None:
        for name, value in fields.items():
            if self.page.locator(f"select#{name}").count():
                self.page.select_option(f"#{name}", value)
            else:
                self.page.fill(f"#{name}", value)

    def card(self, index: int = 0):
        return self.page.locator("#jobs > li").nth(index)

    def wait_status(self, status: str, index: int = 0, timeout_s: float = 90) -> None:
        self.page.locator(f"#jobs > li:nth-child({index + 1})[data-status={status}]").wait_for(timeout=timeout_s * 1000)

    def tab_to(self, element_id: str, limit: int = 30) -> None:
        """Press Tab until ``element_id`` has the focus (the keyboard, not a script, moves it)."""
        for _ in range(limit):
            if self.page.evaluate("document.activeElement.id") == element_id:
                return
            self.page.keyboard.press("Tab")
        raise AssertionError(f"Tab never reached #{element_id}")

    def screenshot(self, moment: str = "") -> Path:
        path = self.shots / f"{self.name}{'-' + moment if moment else ''}.png"
        self.page.screenshot(path=str(path), full_page=True)
        print(f"[playground] screenshot {path}")
        return path

    def close(self) -> None:
        self.ctx.close()


@pytest.fixture
def tab(browser, shots, request):
    tabs: list[Tab] = []

    def open_tab(server, **context) -> Tab:
        t = Tab(browser, server, shots, f"{request.node.name}-{len(tabs)}", **context)
        tabs.append(t)
        return t

    yield open_tab
    for t in tabs:
        try:
            t.screenshot()
        finally:
            t.close()


# ---- served as promised ---------------------------------------------------------------------------
def test_page_files_csp_redirect_and_the_info_route(server_pool) -> None:
    server = server_pool.get("wan-api")
    root = requests.get(server.url + "/", allow_redirects=False, timeout=30)
    assert root.status_code == 307 and root.headers["location"] == "/playground"
    page = requests.get(server.url + "/playground", timeout=30)  # public: the page holds no secret
    assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
    assert "'unsafe-inline'" not in CSP and "script-src 'self'" in CSP
    html = page.text
    assert "<script src=" in html and "<script>" not in html and " style=" not in html and "http" not in html
    for name, kind in (("playground.js", "text/javascript"), ("playground.css", "text/css")):
        resp = requests.get(f"{server.url}/playground/{name}", timeout=30)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith(kind)
        assert "innerHTML" not in resp.text and "http" not in resp.text.replace("HTTP", "")
    denied = requests.get(server.url + "/v1/omni_ext/info", timeout=30)
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    info = requests.get(server.url + "/v1/omni_ext/info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    lim = limits_for_model(server.model)
    assert info["kind"] == "video" and info["pipeline"] == lim.pipeline == "WanPipeline"
    assert info["native"] == {"width": 832, "height": 480, "num_frames": 81, "fps": 16, "steps": 50}
    assert info["sizes"] == size_choices(832, 480, lim.spatial_multiple)
    layout = dict(info["layout"])  # wan-api runs omni-ext's TunedExecutor (tests/test_tenants.py reads its placements)
    assert layout.pop("why") and layout == {"executor": "TunedExecutor", "cfg_parallel_size": 1, "data_parallel_size": 1,
                                            "replicas": 1, "cfg_mode": "adaptive", "priorities": True,
                                            "max_wait_s": 300.0}
    assert info["access"] == {"api_keys": True, "sees": "own"}
    assert set(info["queue"]) == {"running", "queued", "slots", "predicted_wait_s"} and info["queue"]["slots"] == 1
    assert info["guidance"]["field"] == "guidance_scale"


# ---- in the browser -------------------------------------------------------------------------------
def test_a_wrong_key_shows_the_servers_401_then_the_right_one_shows_the_server(server_pool, tab) -> None:
    t = tab(server_pool.get("wan-api"))
    assert t.page.url.endswith("/playground")
    t.page.wait_for_function("() => document.querySelector('#auth-status').textContent.includes('401')")
    t.login("sk-wrong")
    t.page.wait_for_function("() => document.querySelector('#auth-status').textContent.includes('Checking') === false")
    status = t.page.text_content("#auth-status")
    assert "401" in status and "Incorrect or missing API key" in status, status
    assert t.page.evaluate("sessionStorage.getItem('omni-ext.playground.key')") == "sk-wrong"
    assert "sk-wrong" not in t.page.url and "sk-wrong" not in t.page.content()
    t.login(KEY)
    t.ready()
    assert t.page.text_content("#auth-status") == "Key accepted."
    facts = {t.page.text_content(f"dd[data-fact={k}]") for k in ("model", "makes", "native", "layout", "queue")}
    assert "video" in facts and any("832x480, 81 frames at 16 fps" in f for f in facts), facts
    assert any("TunedExecutor: CFG parallel 1" in f for f in facts) and any("running" in f for f in facts), facts
    assert t.page.input_value("#size") == "832x480"
    assert t.dialogs == [] and not t.errors, t.errors


def test_video_progress_to_100_plays_and_survives_a_reload_with_an_xss_prompt_as_text(server_pool, tab) -> None:
    t = tab(server_pool.get("wan-api"))
    t.login(KEY)
    t.ready()
    t.fill(prompt=XSS, negative_prompt="<b>blurry</b>", size="64x64", **{"length-unit": "frames"}, length="9",
           steps="6", guidance="4", seed="3", priority="5")
    t.page.click("#submit")
    t.card().wait_for()
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        seen.append(int(t.card().get_attribute("data-progress") or 0))
        if t.card().get_attribute("data-status") == "completed":
            break
        time.sleep(0.1)
    assert t.card().get_attribute("data-status") == "completed", t.card().text_content()
    # the card may complete between the two reads above: its progress as it stands now
    seen.append(int(t.card().get_attribute("data-progress") or 0))
    assert seen == sorted(seen) and seen[-1] == 100, seen
    assert t.card().get_attribute("data-poll-after-ms") == ""  # a finished job asks for no more polls
    video = t.card().locator("video")
    video.wait_for()
    t.page.wait_for_function("(v) => v.readyState >= 2 && v.videoWidth > 0", arg=video.element_handle())
    played = video.evaluate("v => ({d: v.duration, w: v.videoWidth, h: v.videoHeight, src: v.src, poster: v.poster})")
    assert played["d"] > 0 and (played["w"], played["h"]) == (64, 64), played
    assert played["src"].startswith("blob:") and played["poster"].startswith("blob:")
    assert t.card().locator("a.download").get_attribute("download").endswith(".mp4")
    # The prompt is text: the characters show, no element was made of them, no script ran.
    assert t.card().locator(".prompt").text_content() == XSS
    assert t.page.locator("#jobs img").count() == 0 and t.dialogs == []
    facts = t.card().locator(".facts").text_content()
    assert "64x64, 9 frames" in facts and "priority 5" in facts, facts
    video_id = t.card().get_attribute("data-id")
    t.page.reload()  # the gallery comes back from session storage and the server
    t.wait_status("completed")
    assert t.card().get_attribute("data-id") == video_id and t.card().locator(".prompt").text_content() == XSS
    t.page.wait_for_function("(v) => v && v.readyState >= 2 && v.videoWidth > 0",
                             arg=t.card().locator("video").element_handle())
    assert t.dialogs == [] and not t.errors, t.errors


def test_cancel_a_running_video(server_pool, tab) -> None:
    server = server_pool.get("wan-api")
    t = tab(server)
    t.login(KEY)
    t.ready()
    t.fill(prompt="a long walk", size="128x128", **{"length-unit": "frames"}, length="33", steps="200")
    t.page.click("#submit")
    t.card().wait_for()
    t.page.wait_for_function("() => document.querySelector('#jobs > li').dataset.status === 'in_progress'")
    video_id = t.card().get_attribute("data-id")
    t.card().locator("button.cancel").click()
    t.wait_status("cancelled", timeout_s=30)
    assert "cancelled" in t.card().locator(".status").text_content()
    gone = requests.get(f"{server.url}/v1/videos/{video_id}", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert gone.status_code == 404
    t.page.reload()  # a cancelled job is not part of the gallery
    t.ready()
    assert t.page.locator("#jobs > li").count() == 0


def test_a_full_server_429_is_shown_with_its_retry_after_and_retried_once(server_pool, tab) -> None:
    server = server_pool.get("wan-sched", quiet=True)
    # tests/helpers.py's JOB (~1 s predicted) with 16x the steps: the first two take both slots
    # for ~16 s, so the next request is predicted to wait past the 3 s bound for ~13 s, time enough
    # for a browser on a loaded host to fill the form (with 8x, a CI run under load saw the page's
    # request admitted: the running jobs' predicted rest had fallen under the bound meanwhile).
    job = {"prompt": "a lantern in the fog", "negative_prompt": "blurry", "size": "128x128", "num_frames": 17,
           "num_inference_steps": 128, "guidance_scale": 4.0, "seed": 5}
    t = tab(server)
    t.ready()
    ids = []
    try:
        for _ in range(40):  # fill it up to its bound (as test_admission.fill)
            resp = requests.post(server.url + "/v1/videos", json=job, timeout=60)
            if resp.status_code == 429:
                break
            ids.append(resp.json()["id"])
        assert resp.status_code == 429 and ids
        # the page sends the same long job: a short one is admitted since predicted starts count the
        # step-level pause the executor makes for it (it starts at the running jobs' next step)
        t.fill(prompt=job["prompt"], negative_prompt="blurry", size="128x128", **{"length-unit": "frames"},
               length="17", steps="128", guidance="4", seed="5")
        t.page.click("#submit")
        t.page.wait_for_function("() => document.querySelector('#create-status').textContent.includes('429')")
        busy = t.page.text_content("#create-status")
        assert t.posts[0][0] == 429 and f"Retry-After: {t.posts[0][1]} s" in busy, (t.posts, busy)
        assert "retrying once in" in busy and "max_wait_s" in busy, busy
        t.screenshot("busy")
        # the page waits the Retry-After it was given (tens of seconds where the host runs these jobs slowly)
        t.page.wait_for_function("() => !document.querySelector('#create-status').textContent.includes('retrying')",
                                 timeout=(float(t.posts[0][1]) + 60) * 1000)
        assert len(t.posts) == 2, t.posts  # one retry, by itself, no more
        after = t.page.text_content("#create-status")
        if t.posts[1][0] == 200:
            assert after.startswith("Created video_")
            ids.append(t.card().get_attribute("data-id"))
        else:
            assert after.startswith("Refused: 429"), after
    finally:
        for i in ids:  # leave the server idle for the next test
            requests.delete(f"{server.url}/v1/videos/{i}", timeout=60)


def test_images_by_url_survive_a_reload(server_pool, tab) -> None:
    t = tab(server_pool.get("qwen"))
    t.ready()
    assert t.page.text_content("#auth-status") == "Connected (no key sent)."
    assert t.page.is_hidden("#length") and t.page.is_visible("#n")
    t.fill(prompt="a lighthouse at dusk", size="64x64", n="2", response_format="url", steps="2", seed="7")
    t.page.click("#submit")
    t.wait_status("completed")
    imgs = t.card().locator("img")
    t.page.wait_for_function("() => [...document.querySelectorAll('#jobs img')].filter(i => i.naturalWidth === 64).length === 2")
    assert imgs.count() == 2 and t.card().locator("a.download").count() == 2
    t.page.reload()
    t.wait_status("completed")
    t.page.wait_for_function("() => [...document.querySelectorAll('#jobs img')].filter(i => i.naturalWidth === 64).length === 2")
    assert t.dialogs == [] and not t.errors, t.errors


def test_a_streamed_image_shows_its_previews_then_the_image(server_pool, tab) -> None:
    """One b64 image on a Qwen-Image server: the page streams it (stream, partial_images 2), shows each
    preview the worker decodes in the card as it comes, then the image alone."""
    t = tab(server_pool.get("qwen"))
    bodies: list[dict] = []
    t.page.on("request", lambda r: r.method == "POST" and r.url.endswith("/v1/images/generations")
              and bodies.append(json.loads(r.post_data or "{}")))
    t.ready()
    t.fill(prompt="a kite over the dunes", size="64x64", n="1", response_format="b64_json", steps="8", seed="3")
    t.page.click("#submit")
    t.wait_status("completed")
    assert bodies and bodies[0]["stream"] is True and bodies[0]["partial_images"] == 2, bodies
    assert t.card().get_attribute("data-partials") == "2"
    t.page.wait_for_function("() => [...document.querySelectorAll('#jobs img')].filter(i => i.naturalWidth === 64).length === 1")
    assert t.card().locator("img.preview").count() == 0 and t.card().locator("a.download").count() == 1
    t.screenshot("streamed-image")
    assert t.dialogs == [] and not t.errors, t.errors


def test_phone_width_and_keyboard_only(server_pool, tab) -> None:
    t = tab(server_pool.get("qwen"), viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    t.ready()
    assert t.page.evaluate("document.documentElement.scrollWidth") <= 390
    order = []
    for _ in range(16):
        t.page.keyboard.press("Tab")
        order.append(t.page.evaluate("document.activeElement.id"))
    expected = ["api-key", "key-save", "key-forget", "server-refresh", "prompt", "negative_prompt", "size"]
    assert order[:len(expected)] == expected, order
    assert order.index("submit") > order.index("priority") > order.index("seed") > order.index("steps"), order
    for control in t.page.locator("input, select, textarea").all():  # every field has a label
        if control.is_visible():
            cid = control.get_attribute("id")
            assert t.page.locator(f"label[for={cid}]").count() == 1, cid
    # keyboard alone: type a prompt, pick a size with the arrow keys, type the steps, Enter on Generate
    t.page.evaluate("document.activeElement.blur()")
    t.tab_to("prompt")
    t.page.keyboard.type("a cat on a windowsill")
    t.tab_to("size")
    for _ in range(12):
        if t.page.input_value("#size") == "64x64":
            break
        t.page.keyboard.press("ArrowDown")
    assert t.page.input_value("#size") == "64x64"
    t.tab_to("steps")
    t.page.keyboard.type("2")
    t.tab_to("submit")
    t.page.keyboard.press("Enter")
    t.wait_status("completed")
    t.page.wait_for_function("() => document.querySelector('#jobs img') && document.querySelector('#jobs img').naturalWidth > 0")
    assert t.page.evaluate("document.documentElement.scrollWidth") <= 390
