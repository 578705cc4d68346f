// omni-ext playground: the public OpenAI-style routes of this server, driven from a browser tab.
// Rules: every string from the server or the user goes into the page as text (textContent, never
// parsed as markup); the API key lives in this tab's sessionStorage and travels only as a Bearer header to
// this origin; media is fetched with that header and shown through blob: object URLs.
"use strict";
(() => {
  const KEY = "omni-ext.playground.key";
  const JOBS = "omni-ext.playground.jobs";
  const $ = (id) => document.getElementById(id);
  const jobs = new Map(); // local id -> job (see newJob)
  const PARTIAL_IMAGES = 2; // previews a streamed image asks for (OpenAI allows 0-3)
  let info = null;

  // ---- HTTP -------------------------------------------------------------------------------
  const apiKey = () => sessionStorage.getItem(KEY) || "";

  function request(method, path, body, signal) {
    const headers = {};
    if (apiKey()) headers.Authorization = "Bearer " + apiKey();
    const init = { method, headers, signal, cache: "no-store" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    return fetch(path, init);
  }

  // The OpenAI-style error message of a failed answer ("HTTP 502" when the body has none).
  async function errorText(resp) {
    let msg = "";
    try {
      const body = await resp.json();
      const err = body && body.error;
      msg = typeof err === "string" ? err : (err && err.message) || (body && body.message) || "";
    } catch (e) { /* not JSON */ }
    return `${resp.status}: ${msg || resp.statusText || "HTTP error"}`;
  }

  function retryAfterMs(resp) {
    const ms = parseInt(resp.headers.get("retry-after-ms") || "", 10);
    if (ms > 0) return ms;
    const s = parseFloat(resp.headers.get("retry-after") || "");
    return s > 0 ? s * 1000 : 1000;
  }

  // An answer of 401 anywhere: the key is missing or wrong; say so where the key is typed.
  async function checkAuth(resp) {
    if (resp.status !== 401) return false;
    say($("auth-status"), "Key refused: " + (await errorText(resp.clone())), true);
    return true;
  }

  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  // POST as the OpenAI SDK would; a 429 is shown with its Retry-After and retried once, by itself.
  async function post(path, body, signal, onBusy) {
    let resp = await request("POST", path, body, signal);
    if (resp.status === 429) {
      const wait = retryAfterMs(resp);
      const header = resp.headers.get("retry-after");
      onBusy(`Server busy (${await errorText(resp)}) Retry-After: ${header || (wait / 1000).toFixed(1)} s; ` +
             `retrying once in ${(wait / 1000).toFixed(1)} s…`);
      await sleep(wait);
      resp = await request("POST", path, body, signal);
    }
    return resp;
  }

  // ---- small DOM helpers (text only) -------------------------------------------------------
  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function say(node, text, bad) {
    node.textContent = text;
    node.classList.toggle("error", !!bad);
  }

  function show(node, on) { node.classList.toggle("hidden", !on); }

  const secs = (s) => (s == null ? "?" : s < 90 ? `${Math.round(s)} s` : `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`);

  // ---- server facts --------------------------------------------------------------------------
  async function loadInfo() {
    let resp;
    try {
      resp = await request("GET", "/v1/omni_ext/info");
    } catch (e) {
      say($("model-line"), "Server unreachable: " + e.message, true);
      return;
    }
    if (await checkAuth(resp)) {
      say($("model-line"), "Enter the server's API key to continue.", true);
      $("api-key").focus();
      return;
    }
    if (!resp.ok) {
      say($("model-line"), await errorText(resp), true);
      return;
    }
    const first = info === null;
    info = await resp.json();
    say($("auth-status"), apiKey() ? "Key accepted." : "Connected (no key sent).");
    renderInfo();
    if (first) setupForm();
  }

  function renderInfo() {
    const n = info.native || {};
    const video = info.kind === "video";
    say($("model-line"), `${info.model} — ${video ? "text to video" : "text to image"}`);
    const lay = info.layout;
    const q = info.queue;
    const facts = [
      ["Model", info.model],
      ["Pipeline", `${info.pipeline || "unknown"}${info.family ? ` (${info.family})` : ""}`],
      ["Makes", video ? "video" : "images"],
      ["Native", video ? `${n.width}x${n.height}, ${n.num_frames} frames at ${n.fps} fps, ${n.steps} steps`
                       : `${n.width}x${n.height}, ${n.steps} steps`],
      ["Layout", `${lay.executor}: CFG parallel ${lay.cfg_parallel_size}, ${lay.data_parallel_size} group(s), ` +
                 `${lay.replicas} replica(s), ${q.slots} job(s) at once`],
      ["Queue", `${q.running} running, ${q.queued} queued; ` +
                (q.predicted_wait_s == null ? "predicted wait unknown until a job has finished"
                                            : `a new job would start in about ${secs(q.predicted_wait_s)}`)],
    ];
    const dl = $("server-facts");
    dl.replaceChildren();
    for (const [k, v] of facts) {
      const dt = el("dt", "", k);
      const dd = el("dd", "", v);
      dd.dataset.fact = k.toLowerCase();
      dl.append(dt, dd);
    }
  }

  function setupForm() {
    const video = info.kind === "video";
    document.body.dataset.kind = info.kind;
    $("create-kind").textContent = video ? "video" : "image";
    for (const node of document.querySelectorAll(".video-only")) show(node, video);
    for (const node of document.querySelectorAll(".image-only")) show(node, !video);
    const sel = $("size");
    sel.replaceChildren();
    (info.sizes || []).forEach((s, i) => {
      const opt = el("option", "", i === 0 ? `${s} (native)` : s);
      opt.value = s;
      sel.append(opt);
    });
    const lim = info.limits;
    Object.assign($("steps"), { min: lim.min_steps, max: lim.max_steps, placeholder: String(info.native.steps || "") });
    if (lim.max_guidance != null) $("guidance").max = lim.max_guidance;
    if (info.guidance.default != null) $("guidance").placeholder = String(info.guidance.default);
    Object.assign($("seed"), { max: lim.max_seed });
    for (const id of ["prompt", "negative_prompt"]) $(id).maxLength = lim.max_prompt_chars;
    Object.assign($("priority"), { min: lim.min_priority, max: lim.max_priority });
    Object.assign($("n"), { max: lim.max_outputs });
    $("submit").disabled = false;
  }

  // ---- jobs of this tab (ids in sessionStorage; media always from the server) -------------------
  function saved() {
    try { return JSON.parse(sessionStorage.getItem(JOBS) || "[]"); } catch (e) { return []; }
  }

  function persist() {
    const list = [];
    for (const j of jobs.values()) if (j.keep) list.push(j.entry);
    sessionStorage.setItem(JOBS, JSON.stringify(list));
  }

  function newJob(entry) {
    const card = el("li", "job");
    card.dataset.kind = entry.kind;
    const job = {
      entry, card, keep: true, active: true, timer: null, abort: null, urls: [],
      startedMs: entry.created || Date.now(), doneMs: null, view: null,
      prompt: el("p", "prompt", entry.prompt),
      facts: el("p", "facts muted", ""),
      status: el("p", "status", "Submitting…"),
      bar: el("progress"),
      actions: el("div", "actions"),
      media: el("div", "media"),
      cancel: el("button", "cancel", "Cancel"),
    };
    job.status.setAttribute("role", "status");
    job.bar.max = 100;
    job.bar.setAttribute("aria-label", "Progress");
    job.cancel.type = "button";
    job.cancel.addEventListener("click", () => cancel(job));
    job.actions.append(job.cancel);
    card.append(job.prompt, job.facts, job.status, job.bar, job.actions, job.media);
    $("jobs").prepend(card);
    show($("jobs-empty"), false);
    jobs.set(entry.id, job);
    return job;
  }

  function setStatus(job, text, bad) {
    job.statusText = text;
    job.bad = !!bad;
    renderStatus(job);
  }

  function renderStatus(job) {
    const end = job.doneMs || Date.now();
    say(job.status, `${job.statusText || ""} · elapsed ${secs((end - job.startedMs) / 1000)}`, job.bad);
  }

  function finish(job, keep) {
    job.active = false;
    job.doneMs = job.doneMs || Date.now();
    clearTimeout(job.timer);
    job.cancel.disabled = true;
    show(job.cancel, false);
    if (!keep) {
      job.keep = false;
      persist();
    }
  }

  // ---- videos ------------------------------------------------------------------------------
  async function pollVideo(job) {
    if (!job.active) return;
    let resp;
    try {
      resp = await request("GET", `/v1/videos/${encodeURIComponent(job.entry.id)}`);
    } catch (e) {
      setStatus(job, "Connection lost; retrying…", true);
      job.timer = setTimeout(() => pollVideo(job), 2000);
      return;
    }
    if (!job.active) return;
    if (resp.status === 404) {
      setStatus(job, "No longer on the server (deleted or expired).", true);
      finish(job, false);
      return;
    }
    if (!resp.ok) {
      await checkAuth(resp.clone());
      setStatus(job, await errorText(resp), true);
      job.timer = setTimeout(() => pollVideo(job), 3000);
      return;
    }
    const v = await resp.json();
    const after = parseInt(resp.headers.get("openai-poll-after-ms") || "", 10);
    job.card.dataset.pollAfterMs = Number.isFinite(after) ? String(after) : "";
    updateVideo(job, v);
    if (v.status === "completed") {
      job.doneMs = v.completed_at ? v.completed_at * 1000 : Date.now();
      finish(job, true);
      await loadVideo(job);
    } else if (v.status === "failed") {
      job.doneMs = v.completed_at ? v.completed_at * 1000 : Date.now();
      setStatus(job, `Failed: ${(v.error && v.error.message) || "unknown error"}`, true);
      finish(job, true);
    } else {
      job.timer = setTimeout(() => pollVideo(job), Number.isFinite(after) ? after : 1000);
    }
  }

  function updateVideo(job, v) {
    job.view = v;
    job.startedMs = v.created_at ? v.created_at * 1000 : job.startedMs;
    job.card.dataset.status = v.status;
    job.card.dataset.id = v.id;
    job.bar.value = v.progress || 0;
    job.bar.setAttribute("aria-valuetext", `${v.progress || 0} %`);
    job.card.dataset.progress = String(v.progress || 0);
    const frames = v.num_frames ? `, ${v.num_frames} frames at ${v.fps} fps` : "";
    job.facts.textContent = `${v.id} · ${v.size}${frames} · ${v.seconds} s · priority ${v.priority || 0}`;
    let text = `${v.status} · ${v.progress || 0} %`;
    if (v.status === "queued" && v.queue_position != null) {
      text += v.queue_position === 0 ? " · next in the queue" : ` · ${v.queue_position} job(s) ahead`;
      if (v.predicted_start_at != null) {
        const at = new Date(v.predicted_start_at * 1000).toLocaleTimeString();
        text += ` · predicted start ${at} (in ${secs(v.predicted_wait_s)})`;
      } else {
        text += " · predicted start unknown";
      }
    }
    setStatus(job, text);
  }

  async function fetchBlob(path) {
    const resp = await request("GET", path);
    if (!resp.ok) {
      await checkAuth(resp.clone());
      throw new Error(await errorText(resp));
    }
    return resp.blob();
  }

  async function loadVideo(job) {
    const id = encodeURIComponent(job.entry.id);
    try {
      const [mp4, thumb] = await Promise.all([fetchBlob(`/v1/videos/${id}/content`),
                                              fetchBlob(`/v1/videos/${id}/content?variant=thumbnail`)]);
      const src = URL.createObjectURL(mp4);
      const poster = URL.createObjectURL(thumb);
      job.urls.push(src, poster);
      const video = el("video");
      Object.assign(video, { controls: true, preload: "auto", muted: true, playsInline: true, loop: true });
      video.poster = poster;
      video.src = src;
      video.setAttribute("aria-label", "Generated video: " + job.entry.prompt);
      const a = el("a", "download", "Download MP4");
      a.href = src;
      a.download = `${job.entry.id}.mp4`;
      job.media.replaceChildren(video);
      job.actions.append(a);
    } catch (e) {
      setStatus(job, "Completed, but its content could not be loaded: " + e.message, true);
    }
  }

  async function submitVideo(form) {
    const body = { prompt: form.prompt };
    if (form.negative_prompt) body.negative_prompt = form.negative_prompt;
    if (form.size) body.size = form.size;
    if (form.length) {
      if (form.unit === "seconds") body.seconds = String(form.length);
      else body.num_frames = parseInt(form.length, 10);
    }
    common(body, form);
    const resp = await post("/v1/videos", body, undefined, (msg) => say($("create-status"), msg, true));
    if (!resp.ok) {
      await checkAuth(resp.clone());
      say($("create-status"), "Refused: " + (await errorText(resp)), true);
      return;
    }
    const v = await resp.json();
    say($("create-status"), `Created ${v.id}.`);
    const job = newJob({ id: v.id, kind: "video", prompt: body.prompt, created: Date.now() });
    persist();
    const after = parseInt(resp.headers.get("openai-poll-after-ms") || "", 10);
    job.card.dataset.pollAfterMs = Number.isFinite(after) ? String(after) : "";
    updateVideo(job, v);
    job.timer = setTimeout(() => pollVideo(job), Number.isFinite(after) ? after : 1000);
  }

  // steps, guidance, seed, priority: the extra_body fields both kinds share
  function common(body, form) {
    if (form.steps) body.num_inference_steps = parseInt(form.steps, 10);
    if (form.guidance) body[info.guidance.field] = parseFloat(form.guidance);
    if (form.seed) body.seed = parseInt(form.seed, 10);
    if (form.priority && parseInt(form.priority, 10) !== 0) body.priority = parseInt(form.priority, 10);
  }

  // ---- images (one synchronous request; Cancel closes it, which frees its slot on the server) --
  async function submitImages(form) {
    const body = { prompt: form.prompt, n: parseInt(form.n || "1", 10), size: form.size,
                   response_format: form.response_format };
    if (form.negative_prompt) body.negative_prompt = form.negative_prompt;
    common(body, form);
    // one b64 image from a model that makes previews: streamed, its partial images shown as they come
    const streamed = !!info.partial_images && body.n === 1 && body.response_format === "b64_json";
    if (streamed) {
      body.stream = true;
      body.partial_images = PARTIAL_IMAGES;
    }
    const id = `images-${Date.now()}-${Math.floor(Math.random() * 1e6)}`;
    const job = newJob({ id, kind: "image", prompt: body.prompt, created: Date.now(), paths: [] });
    job.keep = false; // listed after a reload only once the server holds its images
    job.card.dataset.id = id;
    job.card.dataset.status = "in_progress";
    job.bar.removeAttribute("value"); // no step progress on a synchronous request: indeterminate
    job.facts.textContent = `${body.n} image(s) · ${body.size} · ${body.response_format}`;
    setStatus(job, "running (the answer comes with the images)");
    job.abort = new AbortController();
    let resp;
    try {
      resp = await post("/v1/images/generations", body, job.abort.signal, (msg) => {
        say($("create-status"), msg, true);
        setStatus(job, msg, true);
      });
    } catch (e) {
      if (job.cancelled) return;
      setStatus(job, "Connection lost: " + e.message, true);
      finish(job, false);
      return;
    }
    if (!resp.ok) {
      await checkAuth(resp.clone());
      const msg = await errorText(resp);
      say($("create-status"), "Refused: " + msg, true);
      setStatus(job, "Refused: " + msg, true);
      job.card.dataset.status = "failed";
      finish(job, false);
      return;
    }
    let result;
    try {
      result = streamed ? await readImageStream(job, resp) : await resp.json();
    } catch (e) {
      if (job.cancelled) return;
      say($("create-status"), "Failed: " + e.message, true);
      setStatus(job, "Failed: " + e.message, true);
      job.card.dataset.status = "failed";
      finish(job, false);
      return;
    }
    say($("create-status"), `${result.data.length} image(s) generated.`);
    job.card.dataset.status = "completed";
    job.bar.value = 100;
    job.card.dataset.progress = "100";
    setStatus(job, "completed · 100 %");
    finish(job, true);
    const blobs = [];
    for (const item of result.data) {
      if (item.b64_json) {
        const bytes = Uint8Array.from(atob(item.b64_json), (c) => c.charCodeAt(0));
        blobs.push(new Blob([bytes], { type: "image/png" }));
      } else if (item.url) {
        const url = new URL(item.url, location.href);
        // Only this server's image routes get the key (and the page fetches nothing else).
        if (url.origin !== location.origin || !url.pathname.startsWith("/v1/images/")) continue;
        job.entry.paths.push(url.pathname);
      }
    }
    if (job.entry.paths.length) {
      job.keep = true;
      persist();
      await loadImages(job);
    } else {
      job.entry.b64 = true;
      job.keep = true;
      persist();
      showImages(job, blobs);
    }
  }

  // A streamed generation's server-sent events: each partial image replaces the card's preview; the
  // completed event's image is the answer (as {data: [...]}); an error event throws its message.
  async function readImageStream(job, resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    let final = null;
    job.card.dataset.partials = "0";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (!data) continue;
        const event = JSON.parse(data);
        if (event.error) throw new Error(event.error.message || "the generation failed");
        if (event.type && event.type.endsWith(".partial_image")) showPreview(job, event);
        else if (event.type && event.type.endsWith(".completed")) final = event;
      }
    }
    for (const old of job.media.querySelectorAll("img.preview")) old.remove();
    if (!final) throw new Error("the stream ended without an image");
    return { data: [{ b64_json: final.b64_json }] };
  }

  function showPreview(job, event) {
    const bytes = Uint8Array.from(atob(event.b64_json), (c) => c.charCodeAt(0));
    const src = URL.createObjectURL(new Blob([bytes], { type: `image/${event.output_format || "png"}` }));
    job.urls.push(src);
    let img = job.media.querySelector("img.preview");
    if (!img) {
      img = el("img", "preview");
      job.media.append(img);
    }
    img.src = src;
    img.alt = `Preview ${event.partial_image_index + 1}: ${job.entry.prompt}`;
    job.card.dataset.partials = String(event.partial_image_index + 1);
    setStatus(job, `running · preview ${event.partial_image_index + 1} of up to ${PARTIAL_IMAGES}`);
  }

  async function loadImages(job) {
    try {
      showImages(job, await Promise.all(job.entry.paths.map(fetchBlob)));
    } catch (e) {
      setStatus(job, "Images could not be loaded: " + e.message, true);
    }
  }

  function showImages(job, blobs) {
    blobs.forEach((blob, i) => {
      const src = URL.createObjectURL(blob);
      job.urls.push(src);
      const img = el("img");
      img.src = src;
      img.alt = `Generated image ${i + 1}: ${job.entry.prompt}`;
      const a = el("a", "download", `Download image ${i + 1}`);
      a.href = src;
      a.download = `${job.entry.id}-${i + 1}.${(blob.type.split("/")[1] || "png")}`;
      job.media.append(img);
      job.actions.append(a);
    });
  }

  // ---- cancel -------------------------------------------------------------------------------
  async function cancel(job) {
    if (!job.active) return;
    job.cancel.disabled = true;
    if (job.entry.kind === "image") {
      job.cancelled = true;
      job.abort.abort();
      setStatus(job, "cancelled (the request was closed; the server frees its slot)");
      job.card.dataset.status = "cancelled";
      finish(job, false);
      return;
    }
    const resp = await request("DELETE", `/v1/videos/${encodeURIComponent(job.entry.id)}`);
    if (resp.ok || resp.status === 404) {
      clearTimeout(job.timer);
      setStatus(job, "cancelled (deleted on the server)");
      job.card.dataset.status = "cancelled";
      finish(job, false);
    } else {
      await checkAuth(resp.clone());
      setStatus(job, "Cancel failed: " + (await errorText(resp)), true);
      job.cancel.disabled = false;
    }
  }

  // ---- form ---------------------------------------------------------------------------------
  async function onSubmit(ev) {
    ev.preventDefault();
    if (!info) return;
    const form = {
      prompt: $("prompt").value, negative_prompt: $("negative_prompt").value.trim(), size: $("size").value,
      unit: $("length-unit").value, length: $("length").value.trim(), steps: $("steps").value.trim(),
      guidance: $("guidance").value.trim(), seed: $("seed").value.trim(), priority: $("priority").value.trim(),
      n: $("n").value.trim(), response_format: $("response_format").value,
    };
    if (!form.prompt.trim()) {
      say($("create-status"), "A prompt is required.", true);
      $("prompt").focus();
      return;
    }
    say($("create-status"), "Submitting…");
    $("submit").disabled = true;
    try {
      if (info.kind === "video") await submitVideo(form);
      else {
        const pending = submitImages(form);
        $("submit").disabled = false; // an image request can take long: more may be queued meanwhile
        await pending;
      }
    } catch (e) {
      say($("create-status"), "Request failed: " + e.message, true);
    } finally {
      $("submit").disabled = false;
      loadInfo(); // the queue changed
    }
  }

  function restore() {
    for (const entry of saved()) {
      const job = newJob(entry);
      if (entry.kind === "video") {
        pollVideo(job);
      } else if (entry.paths && entry.paths.length) {
        job.card.dataset.status = "completed";
        job.bar.value = 100;
        setStatus(job, "completed · 100 %");
        finish(job, true);
        loadImages(job);
      } else {
        setStatus(job, "b64_json images are not kept by the server; use response format url to keep them.");
        finish(job, true);
      }
    }
  }

  function start() {
    $("submit").disabled = true;
    $("api-key").value = apiKey();
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const k = $("api-key").value.trim();
      if (k) sessionStorage.setItem(KEY, k); else sessionStorage.removeItem(KEY);
      say($("auth-status"), "Checking…");
      loadInfo().then(() => { for (const j of jobs.values()) if (j.active && j.entry.kind === "video") pollVideo(j); });
    });
    $("key-forget").addEventListener("click", () => {
      sessionStorage.removeItem(KEY);
      $("api-key").value = "";
      say($("auth-status"), "Key forgotten.");
    });
    $("server-refresh").addEventListener("click", loadInfo);
    $("create-form").addEventListener("submit", onSubmit);
    setInterval(() => { for (const j of jobs.values()) if (j.active) renderStatus(j); }, 1000);
    setInterval(() => { if (info && !document.hidden) loadInfo(); }, 3000);
    restore();
    loadInfo();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
