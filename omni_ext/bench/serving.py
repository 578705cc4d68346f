"""``omni-ext bench serving``: a closed-loop client workload against serving configurations, back to back.

What a user of a diffusion server asks first is "how many requests per second, and how long does
each take, on my configuration?". This command answers it the way a client sees it: ``--concurrency``
clients each send a request, wait for it to finish, and send the next, until ``--requests`` have been
sent (or ``--duration`` has passed), through the OpenAI routes:

- video ``--mode async`` (default): ``POST /v1/videos`` then ``GET /v1/videos/{id}`` until it ends
  (the official ``openai`` SDK's ``videos.create_and_poll``, every ``--poll-ms``, or as the server's
  ``openai-poll-after-ms`` says with ``--poll-ms 0``), then ``GET /v1/videos/{id}/content``; ``--mode sync``: ``POST /v1/videos/sync`` (plain HTTP: the
  SDK has no such call);
- image: ``POST /v1/images/generations`` with the SDK (``--mode sync``: ``b64_json``; ``--mode
  async``: ``response_format=url``, then the client downloads the URL).

A request's latency is from its first byte sent to its last media byte received. Configurations are
a running server (``--url``), a launch preset (``--preset``, rendered by :mod:`omni_ext.presets`),
ad-hoc serve flags (``--config 'label=ENV=1 --flag value'``) or a built-in set (``--suite
topologies``: stock one device, stock CFG 2, stock DP 2, stock 2 replicas, 2 replicas with
omni-ext's dispatch, tuned CFG 2, tuned DP 2, adaptive). Servers this command starts run one at a time, each alone on the host, on the same
workload (request ``i`` has seed ``--seed + i`` everywhere), after ``--warmup`` unrecorded requests.

Percentiles are over successful requests only (a fast 429 is not a latency); errors are counted by
HTTP status (``connection``, ``timeout``, ``failed`` for a job that ended failed). ``--json`` writes
every request; ``--plot`` draws the latency CDF and requests/s of each configuration.
"""

from __future__ import annotations

import argparse
import re
import shlex
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omni_ext.bench import common as c
from omni_ext.scheduler.config import CfgMode

KINDS = ("video", "image")
MODES = ("async", "sync")
FAMILY = {"video": "wan2.1-t2v", "image": "qwen-image"}
#: Workload defaults per kind. 64x64, 20 steps on the "med" tiny models: a CFG request takes ~2-4 s
#: on one thread, so 16 requests at 4 concurrent show queueing without a long run.
DEFAULTS: dict[str, dict[str, Any]] = {
    "video": {"size": "64x64", "frames": 17, "fps": 8, "steps": 20, "guidance": 4.0, "concurrency": 4,
              "requests": 16, "model_size": "med", "warmup": 2},
    "image": {"size": "64x64", "steps": 20, "guidance": 4.0, "concurrency": 4, "requests": 16,
              "model_size": "med", "warmup": 2},
}
QUICK: dict[str, dict[str, Any]] = {
    "video": {"size": "32x32", "frames": 5, "steps": 2, "concurrency": 2, "requests": 4, "model_size": "tiny",
              "warmup": 1},
    "image": {"size": "32x32", "steps": 2, "concurrency": 2, "requests": 4, "model_size": "tiny", "warmup": 1},
}
_ENV_TOKEN = re.compile(r"^[A-Z_][A-Z0-9_]*=")


# ---- configurations ------------------------------------------------------------------------------
@dataclass
class Config:
    """One configuration under test: a running server (``url``) or serve flags this command starts."""

    label: str
    source: str  # "url", "preset" or "serve"
    url: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    preset: str | None = None
    deploy: dict[str, Any] | None = None  # a preset's deploy YAML, written next to the server log

    def describe(self) -> str:
        if self.source == "url":
            return self.url or ""
        env = "".join(f"{k}={shlex.quote(v)} " for k, v in sorted(self.env.items()))
        what = f"{env}vllm-omni serve MODEL --omni {shlex.join([*c.BASE_ARGS, *self.args])}"
        return f"preset {self.preset}: {what}" if self.preset else what


def suite(kind: str) -> list[Config]:
    """``--suite topologies``: what two workers can do, stock vLLM-Omni next to omni-ext, on one model.

    Stock data parallel is vLLM-Omni's intra-executor DP (``--num-gpus 2`` and the stage's
    ``data_parallel_size`` 2, as ``omni-ext bench data-parallel`` starts it): ``--data-parallel-size``
    is refused under ``--omni``. "2 replicas" is the deploy YAML of the cpu preset of two vLLM-Omni
    replicas: "stock-replicas2" with vLLM-Omni's executor and its round robin on arrival
    (``replica-dispatch`` off), "replicas2" with a TunedExecutor in each and omni-ext's dispatch.
    """
    cfg2 = ["--cfg-parallel-size", "2"]
    tuned = ["--distributed-executor-backend", c.TUNED]
    return [
        Config("stock-1dev", "serve", args=["--distributed-executor-backend", "mp"]),
        Config("stock-cfg2", "serve", args=cfg2),
        Config("stock-dp2", "serve", args=["--num-gpus", "2", "--stage-overrides", '{"0": {"data_parallel_size": 2}}']),
        replicas_config(kind, tuned=False),
        replicas_config(kind, tuned=True),
        Config("tuned-cfg2", "serve", args=[*cfg2, *tuned, *c.additional_config(scheduler={"cfg_mode": CfgMode.PAIR})]),
        Config("tuned-dp2", "serve", args=[*tuned, *c.additional_config(data_parallel_size=2)]),
        Config("adaptive", "serve", args=[*cfg2, *tuned, *c.additional_config(scheduler={"cfg_mode": CfgMode.ADAPTIVE})]),
    ]


def replicas_config(kind: str, *, tuned: bool) -> Config:
    """Two vLLM-Omni replicas from the cpu throughput preset's deploy YAML: with a TunedExecutor in each
    and omni-ext's dispatch (``tuned``), or as vLLM-Omni runs them (its executor, round robin on arrival)."""
    name = "wan2.1-t2v-tiny.cpu.x2.throughput" if kind == "video" else "qwen-image-tiny.cpu.x2.throughput"
    rendered = preset_config(name)
    deploy = c.stock_deploy(rendered.deploy or {})
    if tuned:
        for stage in deploy.get("stages", []):
            stage["distributed_executor_backend"] = c.TUNED
    env = {**rendered.env, **({} if tuned else c.STOCK_DISPATCH_ENV)}
    return Config("replicas2" if tuned else "stock-replicas2", "serve", args=rendered.args, env=env, deploy=deploy)


SUITES: dict[str, Callable[[str], list[Config]]] = {"topologies": suite}


def parse_url(text: str, label: str | None) -> Config:
    """``URL`` or ``label=URL`` (a label given inline wins over ``--label``)."""
    head, sep, rest = text.partition("=")
    if sep and "://" not in head:
        label, text = head, rest
    if "://" not in text:
        raise ValueError(f"--url needs http://HOST:PORT (or label=URL), got {text!r}")
    return Config(label or text.split("://", 1)[1].rstrip("/"), "url", url=text.rstrip("/"))


def parse_config(text: str) -> Config:
    """``label=serve args``; leading ``NAME=value`` tokens of the args are the server's environment,
    e.g. ``stock=OMNI_EXT_DISABLE_PATCHES=all --cfg-parallel-size 2``."""
    label, sep, rest = text.partition("=")
    if not sep or not label or " " in label:
        raise ValueError(f"--config needs label='serve args', got {text!r}")
    tokens = shlex.split(rest)
    env: dict[str, str] = {}
    while tokens and _ENV_TOKEN.match(tokens[0]):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    return Config(label, "serve", args=tokens, env=env)


def preset_config(name: str) -> Config:
    """A catalog preset rendered as ``omni-ext serve --preset`` renders it (flags, environment, deploy YAML).
    The model and port are the started server's (``ServeProcess`` puts them before the flags)."""
    from omni_ext.presets.catalog import get_preset
    from omni_ext.presets.render import RenderOptions, render

    rendered = render(get_preset(name), RenderOptions(model="MODEL", host="127.0.0.1"))
    return Config(name, "preset", args=list(rendered.flags), env=dict(rendered.env), preset=name,
                  deploy=rendered.deploy)


def preset_kind(name: str) -> str:
    """``video`` or ``image``: what the preset's model generates (the family table decides)."""
    from omni_ext.models.families import family_of
    from omni_ext.presets.catalog import get_preset
    from omni_ext.presets.costs import load_cost_table

    fam = family_of(load_cost_table().model(get_preset(name).model).pipeline_class)
    return "video" if fam is None or fam.is_video else "image"


def configurations(args: argparse.Namespace) -> list[Config]:
    """Every configuration in command-line order; labels must be unique (they name the JSON entries)."""
    labels = list(args.labels or [])
    out: list[Config] = []
    for option, value in args.targets or []:
        if option == "url":
            out.append(parse_url(value, labels.pop(0) if labels and "=" not in value.split("://")[0] else None))
        elif option == "preset":
            out.append(preset_config(value))
        elif option == "config":
            out.append(parse_config(value))
        else:
            out.extend(resolve_suite(value, args.kind))
    seen = Counter(cfg.label for cfg in out)
    dup = [label for label, n in seen.items() if n > 1]
    if dup:
        raise ValueError(f"configuration labels must be unique: {', '.join(dup)}")
    return out


def resolve_suite(name: str, kind: str) -> list[Config]:
    """A suite's configurations, presets rendered (under the suite's labels)."""
    out = []
    for cfg in SUITES[name](kind):
        if cfg.preset:
            rendered = preset_config(cfg.preset)
            rendered.label = cfg.label
            cfg = rendered
        out.append(cfg)
    return out


def infer_kind(args: argparse.Namespace) -> str:
    """``--kind``, else what the presets generate (all of them must agree), else video."""
    if args.kind:
        return args.kind
    kinds = {preset_kind(v) for o, v in args.targets or [] if o == "preset"}
    if len(kinds) > 1:
        raise ValueError("the presets mix video and image models: give --kind and presets of one kind")
    return kinds.pop() if kinds else "video"


# ---- requests -------------------------------------------------------------------------------------
def request_fields(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The fields of one request (the same for every configuration but the seed). ``--guidance`` is
    Wan's ``guidance_scale`` or Qwen-Image's ``true_cfg_scale``; an empty ``--negative-prompt``
    leaves it out (Qwen-Image then runs without CFG)."""
    fields: dict[str, Any] = {"prompt": args.prompt, "size": args.size, "num_inference_steps": args.steps, "seed": seed}
    if args.negative_prompt:
        fields["negative_prompt"] = args.negative_prompt
    if args.kind == "video":
        fields.update(num_frames=args.frames, fps=args.fps, guidance_scale=args.guidance)
    else:
        fields["true_cfg_scale"] = args.guidance
    return fields


def error_kind(exc: BaseException) -> str:
    """What an error is counted as: the HTTP status when there is one, else ``timeout``, ``connection``
    or the exception's class name."""
    status = getattr(exc, "status_code", None) or getattr(exc, "status", None)
    if isinstance(status, (int, str)):
        return str(status)
    name = type(exc).__name__
    if "Timeout" in name:
        return "timeout"
    if "Connection" in name:
        return "connection"
    return name


class JobFailed(RuntimeError):
    """An asynchronous job that ended ``failed`` (counted as ``failed``)."""

    status = "failed"


class Client:
    """One configuration's client side: the ``openai`` SDK where it has the call, plain HTTP where not."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        import openai

        self.url, self.args = url, args
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        # The SDK marks its videos API deprecated (OpenAI's Sora shut-down); the calls are what a client of
        # this server uses. A process-wide filter: catch_warnings() is not thread-safe across the clients.
        warnings.filterwarnings("ignore", message="The Sora API", category=DeprecationWarning)
        self.sdk = openai.OpenAI(base_url=url + "/v1", api_key=args.api_key or "unused",
                                 max_retries=args.max_retries, timeout=args.request_timeout)

    def send(self, fields: dict[str, Any]) -> int:
        """One request to the end; the number of media bytes received."""
        if self.args.kind == "image":
            return self._image(fields)
        if self.args.mode == "sync":
            from omni_ext.bench.client import sync_request

            return sync_request(self.url, fields, self.args.request_timeout, self.headers)["bytes"]
        return self._video(fields)

    def _video(self, fields: dict[str, Any]) -> int:
        from openai import omit

        extra = {k: v for k, v in fields.items() if k not in ("prompt", "size")}
        video = self.sdk.videos.create_and_poll(prompt=fields["prompt"], size=fields["size"], extra_body=extra,
                                                poll_interval_ms=self.args.poll_ms or omit)
        if video.status != "completed":
            raise JobFailed(f"job {video.id} ended {video.status}: {getattr(video, 'error', None)}")
        return len(self.sdk.videos.download_content(video.id).read())

    def _image(self, fields: dict[str, Any]) -> int:
        import base64

        import requests

        extra = {k: v for k, v in fields.items() if k not in ("prompt", "size")}
        fmt = "url" if self.args.mode == "async" else "b64_json"
        result = self.sdk.images.generate(prompt=fields["prompt"], size=fields["size"], n=1, response_format=fmt,
                                          extra_body=extra)
        item = result.data[0]
        if fmt == "b64_json":
            return len(base64.b64decode(item.b64_json or ""))
        r = requests.get(item.url, headers=self.headers, timeout=self.args.request_timeout)
        if r.status_code != 200:
            from omni_ext.bench.client import RequestFailed

            raise RequestFailed(r.status_code, r.text)
        return len(r.content)


def timed(send: Callable[[dict[str, Any]], int], i: int, fields: dict[str, Any], t0: float) -> dict[str, Any]:
    """Send one request and record it: index, seed, outcome, latency (from ``t0``-relative send time)."""
    sent = time.monotonic()
    rec: dict[str, Any] = {"i": i, "seed": fields.get("seed"), "sent_s": sent - t0}
    try:
        rec["bytes"] = send(fields)
        rec.update(ok=True, status="200")
    except Exception as exc:  # counted by kind; the run goes on
        rec.update(ok=False, status=error_kind(exc), error=f"{type(exc).__name__}: {str(exc)[:300]}")
    rec["latency_s"] = time.monotonic() - sent
    return rec


def closed_loop(send: Callable[[dict[str, Any]], int], args: argparse.Namespace,
                progress: c.Progress | None = None) -> tuple[list[dict[str, Any]], float]:
    """``--concurrency`` clients, each sending its next request when the previous one ended, until
    ``--requests`` were sent or ``--duration`` passed (requests in flight then still finish).
    Returns the records (in index order) and the wall time."""
    lock = threading.Lock()
    records: list[dict[str, Any]] = []
    counter = iter(range(args.requests if args.requests else 10**9))
    t0 = time.monotonic()
    deadline = t0 + args.duration if args.duration else None

    def next_index() -> int | None:
        with lock:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            return next(counter, None)

    def worker() -> None:
        while (i := next_index()) is not None:
            rec = timed(send, i, request_fields(args, args.seed + i), t0)
            with lock:
                records.append(rec)
                bad = sum(1 for r in records if not r["ok"])
            if progress is not None:
                step = 1 if deadline is None else max(0, int(time.monotonic() - t0) - progress.done)
                progress.advance(step, note=f"{len(records)} done, {bad} errors")

    run_all([worker] * args.concurrency)
    return sorted(records, key=lambda r: r["i"]), time.monotonic() - t0


def warm_up(send: Callable[[dict[str, Any]], int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``--warmup`` requests at once (not recorded in the figures): first-call costs of every worker."""
    if not args.warmup:
        return []
    out: list[dict[str, Any]] = []
    run_all([lambda k=k: out.append(timed(send, -1 - k, request_fields(args, 1 + k), 0.0)) for k in range(args.warmup)])
    return out


def run_all(fns: Sequence[Callable[[], None]]) -> None:
    """Run each function in its own thread, all at once, and wait for all of them."""
    threads = [threading.Thread(target=fn, daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# ---- summary (pure) --------------------------------------------------------------------------------
def errors_by_status(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    return dict(sorted(Counter(r["status"] for r in records if not r["ok"]).items()))


def summarize_config(records: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """Latency percentiles of the successful requests, completed requests per second of wall time,
    and the errors by status."""
    lat = [r["latency_s"] for r in records if r["ok"]]
    errors = errors_by_status(records)
    return {
        "sent": len(records), "ok": len(lat), "errors": errors, "error_count": sum(errors.values()),
        "p50_s": c.percentile(lat, 50), "p90_s": c.percentile(lat, 90), "p99_s": c.percentile(lat, 99),
        "mean_s": sum(lat) / len(lat) if lat else None, "min_s": min(lat, default=None), "max_s": max(lat, default=None),
        "wall_s": wall_s, "requests_per_s": len(lat) / wall_s if wall_s > 0 else None,
    }


def summarize(runs: Sequence[dict[str, Any]], workload: dict[str, Any], host: dict[str, Any],
              ceiling: dict[str, Any] | None, ceiling_absent: str | None, baseline: str | None = None) -> dict[str, Any]:
    """The JSON: per configuration (in run order) its summary, how it was served and every request;
    each one's requests/s and p50 against ``baseline`` (the first configuration unless told)."""
    configs = {r["label"]: {**{k: v for k, v in r.items() if k not in ("records", "wall_s")},
                            **summarize_config(r["records"], r["wall_s"]), "requests": r["records"]} for r in runs}
    base = baseline if baseline in configs else next(iter(configs), None)
    for entry in configs.values():
        ref = configs[base] if base else {}
        entry["requests_per_s_vs_baseline"] = c.ratio(entry["requests_per_s"], ref.get("requests_per_s"))
        entry["p50_vs_baseline"] = c.ratio(entry["p50_s"], ref.get("p50_s"))
    return {
        "benchmark": "serving", "workload": workload, "host": host, "measurement": bool(host.get("measurement", True)),
        "order": list(configs), "baseline": base, "configurations": configs,
        "host_ceiling": ceiling, "host_ceiling_absent": None if ceiling else ceiling_absent,
    }


def table(result: dict[str, Any]) -> str:
    """One comparison table, then the host's state and its bare ceiling (or why there is none)."""
    base = result.get("baseline")
    configs = result["configurations"]
    rows = [[label, f"{e['ok']}/{e['sent']}", _errors_text(e["errors"]), e["p50_s"], e["p90_s"], e["p99_s"],
             e["requests_per_s"], e["requests_per_s_vs_baseline"]] for label, e in ((k, configs[k]) for k in ordered(result))]
    out = [c.format_table(["configuration", "ok/sent", "errors", "p50 (s)", "p90 (s)", "p99 (s)", "req/s",
                           f"req/s vs {base}"], rows)]
    w = result["workload"]
    out.append(f"workload: {w['kind']} {w['mode']}, {w['concurrency']} concurrent clients, "
               + (f"{w['requests']} requests" if w.get("requests") else f"{w['duration_s']} s")
               + f", {_request_text(w['request'])}")
    host = result["host"]
    out.append(f"host: {host.get('cpus')} cpus, load average {_loads(host.get('loadavg_at_start'))} at start, "
               f"{_loads(host.get('loadavg_at_end'))} at end")
    ceil = result.get("host_ceiling")
    if ceil:
        out.append(f"bare host ceiling (no server, transformer loop only): two independent processes "
                   f"{c.fmt(ceil['data_parallel']['throughput_ratio'])}x one; a CFG pair "
                   f"{c.fmt(ceil['cfg_pair']['speedup'])}x one process")
    else:
        out.append(f"bare host ceiling: absent ({result.get('host_ceiling_absent')})")
    out += c.not_a_measurement(result)
    return "\n".join(out)


def ordered(result: dict[str, Any]) -> list[str]:
    """The configurations in run order (a JSON file written with sorted keys keeps it in ``order``)."""
    return [k for k in result.get("order", []) if k in result["configurations"]] or list(result["configurations"])


def _loads(load: Sequence[float] | None) -> str:
    return " / ".join(f"{x:.2f}" for x in load) if load else "-"


def _errors_text(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) or "0"


def _request_text(req: dict[str, Any]) -> str:
    """The request's shape (prompts and the per-request seed left out)."""
    return " ".join(f"{k}={v}" for k, v in req.items() if k not in ("prompt", "negative_prompt", "seed"))


# ---- plot ------------------------------------------------------------------------------------------
def cdf_points(latencies: Sequence[float]) -> tuple[list[float], list[float]]:
    """(sorted latencies, fraction of requests done by each): the empirical CDF's steps."""
    xs = sorted(latencies)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot(result: dict[str, Any], path: str | Path) -> None:
    """Latency CDF per configuration (left) and requests/s per configuration (right), as a PNG."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - matplotlib is in the dev extras
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (it is in omni-ext's dev extras)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result["configurations"]
    labels = ordered(result)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, label in enumerate(labels):
        xs, ys = cdf_points([r["latency_s"] for r in configs[label]["requests"] if r["ok"]])
        if xs:
            left.step([xs[0], *xs], [0.0, *ys], where="post", label=label, color=f"C{i}")
    left.set(xlabel="request latency (s)", ylabel="fraction of requests", title="latency CDF", ylim=(0, 1.02))
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    right.bar(labels, [configs[k]["requests_per_s"] or 0.0 for k in labels], color=[f"C{i}" for i in range(len(labels))])
    right.set(ylabel="completed requests / s", title="throughput")
    plt.setp(right.get_xticklabels(), rotation=25, ha="right", fontsize=8)
    w = result["workload"]
    note = "" if result["measurement"] else "  [NOT A MEASUREMENT: host busy]"
    fig.suptitle(f"omni-ext bench serving: {w['kind']} {w['mode']}, {w['concurrency']} concurrent clients{note}\n"
                 f"{_request_text(w['request'])}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    c.log(f"wrote {path}")


# ---- measuring -------------------------------------------------------------------------------------
def run_one(cfg: Config, url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Warm up, then the closed loop, against one ready server."""
    client = Client(url, args)
    warm = warm_up(client.send, args)
    bad = [w for w in warm if not w["ok"]]
    if bad:
        c.log(f"{cfg.label}: {len(bad)} of {len(warm)} warm-up requests failed: {bad[0].get('error')}")
    total = args.requests if not args.duration else max(1, int(args.duration))
    progress = c.Progress(f"{cfg.label}: {'requests' if not args.duration else 'seconds'}", total)
    try:
        records, wall = closed_loop(client.send, args, progress)
    finally:
        progress.close()
    summary = summarize_config(records, wall)
    c.log(f"{cfg.label}: {summary['ok']}/{summary['sent']} ok, p50 {c.fmt(summary['p50_s'], 2)} s, "
          f"{c.fmt(summary['requests_per_s'])} req/s, errors {_errors_text(summary['errors'])}")
    return {"label": cfg.label, "source": cfg.source, "url": url, "preset": cfg.preset, "records": records,
            "wall_s": wall, "warmup": warm}


def serve_args(cfg: Config, args: argparse.Namespace, workdir: Path) -> list[str]:
    """The flags a started configuration runs with: its own, a preset's deploy YAML written out,
    and ``--api-key`` when the client sends one."""
    flags = list(cfg.args)
    if cfg.deploy is not None:
        import yaml

        path = workdir / f"{safe_name(cfg.label)}.deploy.yaml"
        path.write_text(yaml.safe_dump(cfg.deploy, sort_keys=False), encoding="utf-8")
        flags[flags.index("--deploy-config") + 1] = str(path)
    if args.api_key and "--api-key" not in flags:
        flags += ["--api-key", args.api_key]
    return flags


def safe_name(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", label)


def measure_ceiling(args: argparse.Namespace, model: Path | None) -> tuple[dict[str, Any] | None, str | None]:
    """The bare host's ceiling for two workers (``--ceiling``; Wan only: :mod:`omni_ext.bench.ceiling`
    runs the Wan transformer), or why it is absent."""
    if args.kind != "video" or model is None:
        return None, "only for video with a local model (ceiling.py runs the Wan transformer loop)"
    if not args.ceiling:
        return None, "not measured: pass --ceiling (~2 min)"
    from omni_ext.bench.ceiling import measure

    h, w = c.size_hw(args.size)
    c.log("bare host ceiling (no server): two independent processes vs one, then a CFG pair vs one")
    return {"data_parallel": measure(model, h, w, args.frames, args.steps, independent=True),
            "cfg_pair": measure(model, h, w, args.frames, args.steps)}, None


def workload(args: argparse.Namespace) -> dict[str, Any]:
    return {"kind": args.kind, "mode": args.mode, "concurrency": args.concurrency, "requests": args.requests,
            "duration_s": args.duration, "warmup": args.warmup, "seed": args.seed, "model_size": args.model_size,
            "poll_ms": args.poll_ms or "server hint (openai-poll-after-ms)", "request": request_fields(args, args.seed),
            "threads_per_worker": int(c.BASE_ENV["OMP_NUM_THREADS"])}


def local_model(args: argparse.Namespace, configs: Sequence[Config]) -> Path | None:
    """``--model``, else the tiny model of ``--kind`` (built once) when a configuration is started here."""
    if args.model:
        return Path(args.model)
    if any(cfg.source != "url" for cfg in configs):
        return c.tiny_model(args, FAMILY[args.kind])
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    host = c.quiet_host(args)
    configs = configurations(args)
    model = local_model(args, configs)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="omni-ext-bench-serving-"))
    workdir.mkdir(parents=True, exist_ok=True)
    servers = c.Servers(model or Path("-"), workdir, list(c.BASE_ARGS), dict(c.BASE_ENV))
    runs = []
    try:
        for cfg in configs:
            if cfg.source == "url":
                runs.append(run_one(cfg, cfg.url or "", args))
                continue
            name = safe_name(cfg.label)
            servers.start({name: serve_args(cfg, args, workdir)}, args.start_timeout, {name: cfg.env})
            try:
                runs.append({**run_one(cfg, servers.url(name), args), "command": servers.commands[name]})
            finally:
                servers.stop(name)
    finally:
        servers.stop()
    ceiling, absent = measure_ceiling(args, model)
    c.finish_host(host)
    result = summarize(runs, workload(args), host, ceiling, absent, args.baseline)
    result["workdir"] = str(workdir)
    result["model"] = str(model) if model else None
    return result


# ---- command line ----------------------------------------------------------------------------------
class _Target(argparse.Action):
    """Collects ``--url``/``--preset``/``--config``/``--suite`` in command-line order (one list)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        targets = list(getattr(namespace, "targets", None) or [])
        targets.append((self.dest, values))
        namespace.targets = targets


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``omni-ext bench serving``; workload options default to None so that the
    kind's profile (``DEFAULTS`` / ``QUICK``) fills what the command line leaves unset."""
    p.set_defaults(targets=None)
    g = p.add_argument_group("configurations (any mix, run back to back in command-line order)")
    g.add_argument("--url", action=_Target, help="a running server: URL or label=URL (repeatable)")
    g.add_argument("--label", action="append", dest="labels", help="label of the next --url without one")
    g.add_argument("--preset", action=_Target, help="start a launch preset, e.g. wan2.1-t2v-tiny.cpu.x2.throughput")
    g.add_argument("--config", action=_Target, metavar="LABEL='[ENV=v ...] serve args'",
                   help="start vllm-omni serve with these extra flags (and environment)")
    g.add_argument("--suite", action=_Target, choices=sorted(SUITES),
                   help="topologies: stock 1 device, stock CFG 2, stock DP 2, stock 2 replicas, 2 replicas (omni-ext dispatch), "
                        "tuned CFG 2, tuned DP 2, adaptive")
    g.add_argument("--baseline", default=None, help="label the req/s column is relative to (default: the first)")
    w = p.add_argument_group("workload")
    w.add_argument("--kind", choices=KINDS, default=None, help="video (Wan2.1) or image (Qwen-Image); default: the presets', else video")
    w.add_argument("--mode", choices=MODES, default="async", help="async: create + poll + download; sync: /v1/videos/sync, b64 images")
    w.add_argument("--concurrency", type=int, default=None, help="clients, each with one request in flight")
    w.add_argument("--requests", type=int, default=None, help="requests per configuration")
    w.add_argument("--duration", type=float, default=None, help="instead of --requests: send for this many seconds")
    w.add_argument("--warmup", type=int, default=None, help="unrecorded requests sent at once before each configuration")
    w.add_argument("--size", default=None, help="WxH")
    w.add_argument("--frames", type=int, default=None, help="video frames")
    w.add_argument("--fps", type=int, default=None)
    w.add_argument("--steps", type=int, default=None, help="denoising steps")
    w.add_argument("--guidance", type=float, default=None, help="guidance_scale (video) / true_cfg_scale (image)")
    w.add_argument("--prompt", default=c.PROMPT)
    w.add_argument("--negative-prompt", default=c.NEGATIVE, help="'' for none (Qwen-Image then runs no CFG)")
    w.add_argument("--seed", type=int, default=1000, help="request i has seed SEED + i")
    w.add_argument("--api-key", default=None, help="sent as Bearer token (and given to the servers started here)")
    w.add_argument("--max-retries", type=int, default=0, help="SDK retries (429 included); 0 counts every refusal")
    w.add_argument("--poll-ms", type=int, default=200,
                   help="status-poll interval of async videos (0: the server's openai-poll-after-ms, as the SDK "
                        "does by default; up to a quarter of the predicted time, which blurs the latencies)")
    w.add_argument("--request-timeout", type=float, default=1800.0)
    o = p.add_argument_group("servers and output")
    o.add_argument("--model", default=None, help="model folder for started servers (default: build the tiny model)")
    o.add_argument("--model-size", choices=["tiny", "small", "med"], default=None, help="tiny model to build")
    o.add_argument("--models-dir", default=None, help="where the tiny model is built/cached")
    o.add_argument("--workdir", default=None, help="server logs and storage (default: a new temp dir)")
    o.add_argument("--start-timeout", type=float, default=1200.0)
    o.add_argument("--ceiling", action="store_true", help="also measure the bare host ceiling (video; ~2 min)")
    c.add_quiet_options(o)
    o.add_argument("--quick", action="store_true", help="a small, fast workload (smoke test; figures are not meaningful)")
    o.add_argument("--dry-run", action="store_true", help="print the configurations and the request; start nothing")
    o.add_argument("--json", default=None, help="write every request and the summary here")
    o.add_argument("--plot", default=None, help="write the latency CDF and req/s bar chart here (PNG)")


def prepare(args: argparse.Namespace) -> None:
    """Resolve ``--kind`` and fill the kind's profile; reject a workload that cannot run."""
    if not args.targets:
        raise SystemExit("omni-ext bench serving: name at least one --url, --preset, --config or --suite")
    try:
        args.kind = infer_kind(args)
    except (ValueError, KeyError) as exc:
        raise SystemExit(f"omni-ext bench serving: {exc}") from exc
    c.apply_profile(args, DEFAULTS[args.kind], QUICK[args.kind])
    if args.duration:
        args.requests = None
    for name in ("concurrency", "requests"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SystemExit(f"omni-ext bench serving: --{name} must be at least 1")


def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    model = args.model or str(c.model_path(args, FAMILY[args.kind]))
    return {"benchmark": "serving", "model": model, "workload": workload(args),
            "configurations": {cfg.label: {**asdict(cfg), "runs": cfg.describe()} for cfg in configurations(args)}}


def main(args: argparse.Namespace) -> int:
    prepare(args)
    if args.dry_run:
        try:
            return c.print_plan(dry_run(args))
        except ValueError as exc:
            raise SystemExit(f"omni-ext bench serving: {exc}") from exc
    result = run(args)
    text = table(result)
    if args.plot:
        plot(result, args.plot)
        result["plot"] = str(args.plot)
    if args.json:
        return c.write_result(args.json, result, text)
    print(text, flush=True)
    return 0
