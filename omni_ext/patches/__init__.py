"""The registry of omni-ext's runtime patches to vLLM-Omni: data first, code second.

Every monkeypatch omni-ext makes is one :class:`Patch` entry in :data:`PATCHES`. The same list is
read by the code that applies patches (:func:`apply_patches`), by ``omni-ext patches list`` and by
the tests, so what is documented is what runs. Each entry says:

- ``target``: the exact object replaced, ``module:Qualified.name``; a patch that replaces several
  lists them all, separated by ``", "`` (:attr:`Patch.targets`);
- ``why``: the bug or gap, with the symptom an operator would see;
- ``versions``: the vLLM-Omni versions (PEP 440 specifier) the patch was written and tested for.
  On any other version it is skipped with one warning: upstream may have fixed or moved the code;
- ``where``: which processes need it: ``worker`` (every process that may host a diffusion worker;
  cheap to apply anywhere), ``api`` (only the process serving HTTP) or ``tuned-worker`` (only the
  worker processes of omni-ext's TunedExecutor); :func:`process_roles` tells which apply here;
- ``diff``: the same fix as an upstreamable unified diff under ``patches/`` (checked by a test to
  still apply to the installed vLLM-Omni source);
- ``test``: the test that shows the bug without the patch;
- ``removal``: when the patch can go.

Patches are applied once per process, idempotently, and logged once. An operator can switch one off
with ``OMNI_EXT_DISABLE_PATCHES=name[,name]`` (or ``all``). Patch bodies replace objects through
:func:`patch_attr`, which marks each replacement so that applying a body twice never wraps twice.

The other private names of vLLM-Omni that omni-ext relies on without replacing them are declared
beside this registry, in :mod:`omni_ext.patches.couplings`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Any, TypeVar

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from omni_ext.models.families import cancellable_classes

logger = logging.getLogger("omni_ext.patches")

DISABLE_ENV = "OMNI_EXT_DISABLE_PATCHES"
API_SERVER_MODULE = "vllm_omni.entrypoints.openai.api_server"  # loaded only in the process serving HTTP
ROLE_MODULE = "omni_ext.executor.role"  # its ROLE.tuned_worker marks a TunedExecutor worker process


@dataclass(frozen=True)
class Patch:
    name: str
    target: str
    why: str
    versions: str
    where: str
    diff: str
    test: str
    removal: str
    upstream: str
    apply: str  # "module:function" that performs the patch; returns nothing, must be idempotent
    notes: str = ""

    def applies_to(self, version: str) -> bool:
        return Version(version) in SpecifierSet(self.versions)

    @property
    def targets(self) -> tuple[str, ...]:
        """Every object the patch replaces (``target`` lists them separated by ``", "``)."""
        return tuple(t.strip() for t in self.target.split(", "))


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="async-output-no-accelerator",
        target="vllm_omni.diffusion.worker.diffusion_worker:WorkerProc._async_output_loop",
        why=(
            "The worker's background output thread builds a D2H stream from "
            "torch.accelerator.current_accelerator().type, which is None on a host without an "
            "accelerator: the thread dies with AttributeError, the first (warm-up) request of every "
            "multi-process server (mp executor, --cfg-parallel-size 2) waits for "
            "VLLM_OMNI_ASYNC_OUTPUT_TIMEOUT (600 s) and SIGINT no longer stops the server. "
            "Fixed by packing the output synchronously (no side stream, no pinned memory) when "
            "there is no accelerator; behaviour with an accelerator is unchanged."
        ),
        versions="==0.30.0",
        where="worker",
        diff="patches/0001-worker-async-output-without-accelerator.diff",
        test="tests/test_patches.py::test_async_output_loop_bug_and_fix",
        removal="Drop once the upstream diff (or an equivalent) is in a vLLM-Omni release we pin.",
        upstream="not yet filed; patches/0001-worker-async-output-without-accelerator.diff is ready to send",
        apply="omni_ext.patches.async_output:apply",
    ),
    Patch(
        name="validate-diffusion-requests",
        target="vllm_omni.entrypoints.async_omni:AsyncOmni.generate",
        why=(
            "vLLM-Omni accepts diffusion requests the model cannot honour and answers HTTP 200 with "
            "something else: a 30x30 Wan request is silently floored to 16x16, num_inference_steps=0 "
            "returns undenoised noise, num_frames=0 becomes 1 frame, and Qwen-Image with 1 step "
            "returns NaN. Every route reaches the engine through AsyncOmni.generate, so the check "
            "there rejects these with HTTP 400 (OmniClientError) before anything is queued."
        ),
        versions="==0.30.0",
        where="api",
        diff="patches/0002-async-omni-validate-diffusion-requests.diff",
        test="tests/test_serving.py::test_stock_accepts_bad_size_silently",
        removal="Drop once vLLM-Omni validates request shapes against the model (upstream diff ready).",
        upstream="not yet filed; patches/0002-async-omni-validate-diffusion-requests.diff is ready to send",
        apply="omni_ext.patches.request_validation:apply",
    ),
    Patch(
        name="step-progress",
        target=(
            "vllm_omni.diffusion.models.progress_bar:ProgressBarMixin.progress_bar, "
            "vllm_omni.diffusion.worker.diffusion_model_runner:DiffusionModelRunner._execute_request_list"
        ),
        why=(
            "vLLM-Omni has no per-step progress path to HTTP: GET /v1/videos/{id} reports progress 0 "
            "until it jumps to 100, so clients cannot tell a 3-minute video from a hung one. The "
            "denoise loop already drives ProgressBarMixin.progress_bar on rank 0; the patch also "
            "records each step (and, via DiffusionModelRunner._execute_request_list, which request "
            "it belongs to) in a small file the API process reads when a client polls."
        ),
        versions="==0.30.0",
        where="worker",
        diff="patches/0003-diffusion-step-progress-reporting.diff",
        test="tests/test_api.py::test_progress_moves_and_poll_header",
        removal="Drop once vLLM-Omni streams per-step progress to the API process (upstream diff ready).",
        upstream="not yet filed; patches/0003-diffusion-step-progress-reporting.diff is ready to send",
        apply="omni_ext.patches.step_progress:apply",
    ),
    Patch(
        name="cancel-at-step",
        target=", ".join(cancellable_classes()),
        why=(
            "Deleting a running video job aborts the request in the engine, but Wan and Qwen-Image do not "
            "opt into vLLM-Omni's cooperative cancellation, so the workers keep denoising to the last "
            "step and the next request waits for a job nobody wants. The patch opts both pipelines in "
            "and checks the cancellation flags (a collective over the ranks) at every denoise step."
        ),
        versions="==0.30.0",
        where="worker",
        diff="patches/0006-wan-qwen-image-cooperative-cancellation.diff",
        test="tests/test_api.py::test_delete_cancels_running_job",
        removal="Drop once the pipelines set supports_request_cancellation upstream (diff ready).",
        upstream="not yet filed; patches/0006-wan-qwen-image-cooperative-cancellation.diff is ready to send",
        apply="omni_ext.patches.step_progress:apply_cancellation",
        notes=(
            "Sets supports_request_cancellation on the vLLM-Omni class of every family marked cancellable "
            "in omni_ext.models.families (the target lists them: Wan and the Qwen-Image family, edit included)."
        ),
    ),
    Patch(
        name="openai-routes",
        target=(
            "vllm_omni.entrypoints.openai.api_server:router, "
            "vllm_omni.entrypoints.openai.api_server:omni_init_app_state"
        ),
        why=(
            "vLLM-Omni has no hook for routes, and its /v1/videos accepts only multipart (OpenAI SDKs "
            "before 2.27 send JSON), keeps jobs in memory (a restart loses them), reports no progress "
            "or poll interval, lacks response_format=url for images, and encodes MP4s on the event "
            "loop. Its /health knows nothing of a TunedExecutor replacing its workers. The patch swaps those "
            "routes on vLLM-Omni's module router for omni-ext's before the app includes it (/health first "
            "reads the executors' healing records), and opens omni-ext's job store, starts the healing "
            "watch, puts the drain in front of the engine's stop and re-queues the requests kept by a "
            "previous process (omni_ext.api.drain) when the app state is initialised."
        ),
        versions="==0.30.0",
        where="api",
        diff="patches/0004-api-server-route-plugins.diff",
        test="tests/test_api.py::test_json_create_rejected_by_stock_route",
        removal="Register the router through the vllm_omni.api_routes entry-point group once upstream has it (diff 0004).",
        upstream="not yet filed; patches/0004-api-server-route-plugins.diff adds the hook",
        apply="omni_ext.patches.openai_routes:apply",
    ),
    Patch(
        name="openai-auth-errors",
        target="vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware.__call__",
        why=(
            "With --api-key, vLLM answers a missing or wrong key with 401 {\"error\": \"Unauthorized\"}, "
            "which OpenAI SDKs cannot parse (no error.message). Same check and status, OpenAI-shaped body. "
            "Also lets a signed, unexpired image link in without a key (omni_ext.api.signed: an <img> tag "
            "cannot send one; on only when omni_ext.api.signed_url_ttl_s is set; omni-ext's own, not upstream)."
        ),
        versions="==0.30.0",
        where="api",
        diff="patches/0005-vllm-auth-openai-error-body.diff",
        test="tests/test_api.py::test_api_key_enforced_with_openai_error",
        removal="Drop once vLLM's AuthenticationMiddleware returns an OpenAI-style error body.",
        upstream="not yet filed; patches/0005-vllm-auth-openai-error-body.diff is ready to send",
        apply="omni_ext.patches.auth_errors:apply",
    ),
    Patch(
        name="idle-poll-backoff",
        target=(
            "vllm_omni.engine.orchestrator:asyncio.sleep, vllm_omni.entrypoints.async_omni_base:asyncio.sleep, "
            "vllm_omni.engine.stage_pool:StagePool.poll_diffusion_output, "
            "vllm_omni.engine.orchestrator:OrchestratorBase.__init__"
        ),
        why=(
            "The API process polls for outputs every 1 ms in two loops (orchestrator stage poll, final-output "
            "loop): an idle server burns 10-15 % of a CPU core, and while a request runs the wake-ups preempt "
            "the diffusion workers. CFG ranks meet at an all-gather every step, so a preempted rank stalls "
            "its partner: on a 2-core host this alone held cfg-2 at ~1.5x instead of ~1.8x. Polls stay at "
            "1 ms while outputs flow and back off to OMNI_EXT_POLL_IDLE_MS (10 ms) after "
            "OMNI_EXT_POLL_HOT_MS (50 ms) without one, and to OMNI_EXT_POLL_DEEP_IDLE_MS (100 ms) after a "
            "second with no request in flight (an idle server: 2.5 % of a core at 10 ms, 0.9 % at 100 ms)."
        ),
        versions="==0.30.0",
        where="api",
        diff="patches/0007-orchestrator-idle-poll-backoff.diff",
        test="tests/test_patches.py::test_idle_server_cpu_bug_and_fix",
        removal="Drop once vLLM-Omni waits on its output queues instead of polling (or backs off itself).",
        upstream="not yet filed; patches/0007-orchestrator-idle-poll-backoff.diff is ready to send",
        apply="omni_ext.patches.idle_poll:apply",
        notes=("Costs a diffusion request at most OMNI_EXT_POLL_IDLE_MS of extra latency, and one that finishes "
               "within OMNI_EXT_POLL_DEEP_IDLE_MS of arriving at an idle server at most that; set both to 1 to turn "
               "the backoff off."),
    ),
    Patch(
        name="tuned-worker-skip-empty-kv-receive",
        target="vllm_omni.diffusion.worker.diffusion_model_runner:DiffusionModelRunner.__init__",
        why=(
            "With no KV connector configured, DiffusionModelRunner still broadcasts an empty KV payload over "
            "the WORLD group before every request. omni-ext's TunedExecutor runs different requests on "
            "different ranks (data parallel, one-rank CFG-free jobs), so that broadcast would block a rank "
            "until another rank starts a request. The manager is dropped when it has nothing to receive "
            "(the runner's own no-manager path)."
        ),
        versions="==0.30.0",
        where="tuned-worker",
        diff="patches/0008-diffusion-runner-no-kv-manager-without-connector.diff",
        test="tests/test_executor.py::test_two_groups_run_two_requests_concurrently",
        removal="Drop once vLLM-Omni skips the KV receive when no connector is configured.",
        upstream="not yet filed; patches/0008-diffusion-runner-no-kv-manager-without-connector.diff is ready to send",
        apply="omni_ext.patches.kv_broadcast:apply",
        notes="Applied only inside TunedExecutor worker processes; vLLM-Omni's own executors are untouched.",
    ),
    Patch(
        name="executor-abort-hook",
        target="vllm_omni.diffusion.diffusion_engine:DiffusionEngine.abort",
        why=(
            "DiffusionEngine forgets a request once an async executor has taken it (its scheduler marks it "
            "finished and its cancellation signal is released), so abort() - e.g. DELETE /v1/videos/{id} - "
            "never reaches the executor and the request runs to its last step, holding the workers. After "
            "the stock abort, the ids are passed to executor.abort_requests() when the executor has one "
            "(omni-ext's TunedExecutor); other executors are unaffected."
        ),
        versions="==0.30.0",
        where="worker",
        diff="patches/0009-diffusion-engine-abort-reaches-async-executor.diff",
        test="tests/test_executor.py::test_delete_stops_a_running_tuned_job_and_frees_its_ranks",
        removal="Drop once vLLM-Omni forwards aborts of handed-over requests to the executor.",
        upstream="not yet filed; patches/0009-diffusion-engine-abort-reaches-async-executor.diff is ready to send",
        apply="omni_ext.patches.executor_abort:apply",
    ),
    Patch(
        name="gloo-shared-device",
        target="torch.distributed.distributed_c10d:ProcessGroupGloo",
        why=(
            "A vLLM-Omni diffusion worker creates ~19 gloo process groups (WORLD, plus a device and a CPU "
            "group per parallel dimension), and torch gives each its own gloo TCP device, whose event-loop "
            "thread wakes every 10 ms: ~1,900 idle wake-ups/s and 3-4 % of a core per worker, all the time. "
            "On a host with as many cores as workers that time comes out of the denoise loops, and a CFG "
            "pair (an all-gather every step) loses it twice. All gloo groups of a process are built on one "
            "shared device instead (one loop thread), through torch's own ProcessGroupGloo options."
        ),
        versions="==0.30.0",
        where="worker",
        diff="patches/0010-diffusion-gloo-groups-share-one-device.diff",
        test="tests/test_patches.py::test_gloo_loop_threads_bug_and_fix",
        removal="Drop once vLLM-Omni builds its gloo groups on one device (or gloo's loop stops polling).",
        upstream="not yet filed; patches/0010-diffusion-gloo-groups-share-one-device.diff is ready to send",
        apply="omni_ext.patches.gloo_device:apply",
        notes="Also GLOO_SOCKET_IFNAME is honoured as by torch (one shared device per listed interface).",
    ),
    Patch(
        name="replica-dispatch",
        target=(
            "vllm_omni.engine.stage_pool:StagePool.submit_initial, vllm_omni.engine.stage_pool:StagePool.release_binding, "
            "vllm_omni.engine.stage_pool:StagePool.abort_requests, vllm_omni.engine.stage_pool:StagePool.evict_replica, "
            "vllm_omni.engine.stage_pool:StagePool.invalidate_addr, vllm_omni.engine.stage_pool:StagePool.add_client, "
            "vllm_omni.engine.orchestrator:Orchestrator.run"
        ),
        why=(
            "With several replicas (num_replicas in a deploy YAML, or a multi-machine head with headless replicas) "
            "vLLM-Omni binds each request on arrival: StagePool round robin in one server, the head's random or "
            "least-queue-length balancer (a count refreshed every 5 s) across hosts. Neither sees a request's cost, "
            "and a request bound to a busy replica waits in its FIFO while another replica idles: on a mixed "
            "81/17-frame burst round robin ends 1.21-1.42x after the makespan bound (RFC #5135: 18-34 % lost on "
            "GPUs). The head keeps the queue instead and binds a request when a replica has a free slot, in the "
            "scheduler's order (priority, aging, longest first), to the replica predicted to finish it first "
            "(omni_ext.scheduler.replicas); vLLM-Omni's binding tables, CFG-companion affinity and replica-loss "
            "clean-up are kept."
        ),
        versions="==0.30.0",
        where="api",
        diff="patches/0011-stage-pool-replica-dispatch-policy.diff",
        test="tests/test_replicas.py::test_stock_round_robin_binds_on_arrival",
        removal="Register omni-ext's policy through the stage-pool dispatch entry point once upstream has one (diff 0011).",
        upstream="not yet filed; patches/0011-stage-pool-replica-dispatch-policy.diff proposes a dispatch-policy hook",
        apply="omni_ext.patches.replica_dispatch:apply",
        notes="Only diffusion stages with more than one replica slot, or a multi-machine head, are affected.",
    ),
    Patch(
        name="replica-send-nonblocking",
        target=(
            "vllm_omni.diffusion.stage_diffusion_client:StageDiffusionClient._connect_transport, "
            "vllm_omni.diffusion.stage_diffusion_client:StageDiffusionClient.abort_requests_async"
        ),
        why=(
            "The head sends requests to a diffusion replica with a blocking ZMQ PUSH send from the orchestrator's "
            "event loop. When a headless replica (or its host) dies, the socket has no peer and the next send "
            "blocks forever: every later request hangs, heartbeat time-outs are never acted on and /health still "
            "answers 200. Sends no longer block: a message that cannot be queued within 0.5 s raises "
            "EngineDeadError, which vLLM-Omni and omni-ext's dispatcher handle by failing or re-sending that "
            "request and leaving the replica out; aborts to such a replica are dropped with a warning."
        ),
        versions="==0.30.0",
        where="api",
        diff="patches/0012-diffusion-client-nonblocking-send.diff",
        test="tests/test_replicas.py::test_send_to_a_replica_that_is_gone_blocks_stock_and_raises_patched",
        removal="Drop once StageDiffusionClient sends without blocking (diff 0012).",
        upstream="not yet filed; patches/0012-diffusion-client-nonblocking-send.diff is ready to send",
        apply="omni_ext.patches.replica_send:apply",
    ),
    Patch(
        name="dp-world",
        target=(
            "vllm_omni.config.omni_config:_stage_engine_values, "
            "vllm_omni.config.config_factory:StageConfigFactory._normalize_default_diffusion"
        ),
        why=(
            "omni-ext's data parallelism (--additional-config '{\"omni_ext\": {\"data_parallel_size\": N}}') "
            "was invisible to vLLM-Omni's start-up: the stage's world, devices, device check, locks and num_gpus "
            "counted CFG alone, and the TunedExecutor raised the world to N x CFG only afterwards; with fewer "
            "visible devices than that, the extra ranks died in set_device with only 'exited during start-up'. "
            "The key now becomes the stage's own data_parallel_size where vLLM-Omni merges the stage's engine "
            "values (and where the generic fallback computes its devices), so the start-up sees the whole world "
            "and refuses a layout that needs more devices than are visible, naming both numbers."
        ),
        versions="==0.30.0",
        where="worker",
        diff="patches/0013-diffusion-data-parallel-from-additional-config.diff",
        test="tests/test_devices.py::test_stage_world_counts_omni_ext_dp",
        removal="Drop if omni-ext's key goes (users would set the stage's data_parallel_size), or upstream reads it.",
        upstream="not filed: the key is omni-ext's own; the diff shows the same change in vLLM-Omni's source",
        apply="omni_ext.patches.dp_world:apply",
    ),
    Patch(
        name="dmd2-forward-kwargs",
        target="vllm_omni.diffusion.models.dmd2.mixin:DMD2PipelineMixin.forward",
        why=(
            "Every DMD2-distilled pipeline vLLM-Omni registers on a Wan or Qwen-Image base "
            "(WanT2VDMD2Pipeline, WanI2VDMD2Pipeline, QwenImageDMD2Pipeline; LTX2's two too) dies in the "
            "server's warm-up with 'Dummy run failed: Wan22Pipeline.forward() got an unexpected keyword "
            "argument guidance_scale': the mixin passes guidance_scale and num_inference_steps to a base "
            "forward that takes the request batch alone. The request's sampling params already carry both "
            "(_sanitize_dmd2_request), so they are passed only to a base forward that declares them."
        ),
        versions="==0.30.0",
        where="worker",
        diff="patches/0014-dmd2-mixin-forward-kwargs.diff",
        test="tests/test_patches.py::test_dmd2_forward_bug_and_fix",
        removal="Drop once the upstream diff (or an equivalent) is in a vLLM-Omni release we pin.",
        upstream="not yet filed; patches/0014-dmd2-mixin-forward-kwargs.diff is ready to send",
        apply="omni_ext.patches.dmd2_forward:apply",
    ),
    Patch(
        name="http-header-timeout",
        target="vllm_omni.entrypoints.openai.api_server:serve_http",
        why=(
            "vLLM-Omni serves through vLLM's serve_http with uvicorn's automatic protocol (httptools), which "
            "waits for a request's headers for ever: a client that sends one header byte every few seconds "
            "(slowloris) holds a connection and a file descriptor indefinitely, since every byte cancels "
            "uvicorn's keep-alive timer and the app is only called once the headers are complete. The "
            "serve_http that vLLM-Omni calls passes uvicorn's documented 'http' option: the same protocol "
            "with a header time-out (omni_ext.api.header_timeout_s, default 30 s; 408 and close)."
        ),
        versions="==0.30.0",
        where="api",
        diff="patches/0015-http-header-read-timeout.diff",
        test="tests/test_bodies.py::test_header_trickle_bug_and_fix",
        removal="Drop once vLLM's serve_http (or uvicorn) bounds the time to a request's headers.",
        upstream="not yet filed; patches/0015-http-header-read-timeout.diff (against vLLM's launcher) is ready to send",
        apply="omni_ext.patches.http_timeouts:apply",
    ),
    Patch(
        name="partial-images",
        target=(
            "vllm_omni.diffusion.models.qwen_image.cfg_parallel:QwenImageCFGParallelMixin.diffuse, "
            "vllm_omni.diffusion.distributed.cfg_parallel:CFGParallelMixin.scheduler_step_maybe_with_cfg"
        ),
        why=(
            "OpenAI's image API streams partial images (stream=true, partial_images 1-3): previews while an "
            "image is made, which the SDK's streaming iterator and chat front-ends show. vLLM-Omni's denoise loop "
            "has no hook where a preview could be taken, so a streamed request could only ever get its final "
            "image. Qwen-Image's loop is wrapped to note which requests asked for previews, and the CFG scheduler "
            "step to decode the clean-latent estimate after evenly spaced steps on the rank that reports the "
            "job's progress (omni_ext.partials); latents, RNG and output are untouched."
        ),
        versions="==0.30.0",
        where="worker",
        diff="patches/0016-qwen-image-step-callback-partial-images.diff",
        test="tests/test_partials.py::test_streamed_generation_sends_partials_then_the_same_image",
        removal="Drop once vLLM-Omni's image loops take a step callback (upstream diff ready) and serve partials.",
        upstream="not yet filed; patches/0016-qwen-image-step-callback-partial-images.diff is ready to send",
        apply="omni_ext.patches.partial_images:apply",
    ),
    Patch(
        name="edit-partial-images",
        target="vllm_omni.entrypoints.openai.api_server:_generate_with_async_omni",
        why=(
            "OpenAI's images.edit takes partial_images for streamed edits; vLLM-Omni's edit endpoint, which "
            "omni-ext's edit route hands the checked form so that an edit gives stock's bytes, has no such "
            "field, so the worker could not know that an edit wants previews. The engine call that endpoint "
            "makes carries the count omni-ext's route set for the request (a context variable) in the sampling "
            "params' extra_args."
        ),
        versions="==0.30.0",
        where="api",
        diff="patches/0017-images-edits-carry-partial-images.diff",
        test="tests/test_tuned_families.py::test_streamed_edit_sends_partials_then_the_same_image",
        removal="Drop once vLLM-Omni's edit endpoint carries partial_images (upstream diff ready).",
        upstream="not yet filed; patches/0017-images-edits-carry-partial-images.diff is ready to send",
        apply="omni_ext.patches.partial_images:apply_edits",
    ),
)


@dataclass
class PatchState:
    applied: dict[str, str] = field(default_factory=dict)  # name -> "applied" | "skipped: reason"
    warned: set[str] = field(default_factory=set)


_STATE = PatchState()


def omni_version() -> str | None:
    try:
        return importlib.metadata.version("vllm-omni")
    except importlib.metadata.PackageNotFoundError:
        return None


def _disabled(environ: dict[str, str] | None = None) -> set[str]:
    raw = (os.environ if environ is None else environ).get(DISABLE_ENV, "")
    return {x.strip() for x in raw.split(",") if x.strip()}


def switched_off(name: str, environ: dict[str, str] | None = None) -> bool:
    """Whether the operator switched patch ``name`` off (``OMNI_EXT_DISABLE_PATCHES``: ``name`` or ``all``)."""
    off = _disabled(environ)
    return name in off or "all" in off


def resolve(qualname: str) -> Any:
    """The object named ``module:Qualified.name`` (imports the module)."""
    module, _, qual = qualname.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def process_roles() -> set[str]:
    """Roles of this process: always ``worker``; ``api`` when vLLM-Omni's HTTP server is loaded here;
    ``tuned-worker`` in a worker process of omni-ext's TunedExecutor.

    A TunedExecutor worker sets ``omni_ext.executor.role.ROLE.tuned_worker`` before vLLM-Omni loads
    its general plugins, whose activation (:func:`omni_ext.plugin.register_omni`) then applies the
    ``tuned-worker`` patches. The flag is read through ``sys.modules``: the registry imports nothing
    from the executor.
    """
    roles = {"worker"}
    if API_SERVER_MODULE in sys.modules:
        roles.add("api")
    if getattr(getattr(sys.modules.get(ROLE_MODULE), "ROLE", None), "tuned_worker", False):
        roles.add("tuned-worker")
    return roles


def apply_patches(
    roles: set[str] | None = None,
    patches: tuple[Patch, ...] | None = None,
    version: str | None = None,
    state: PatchState | None = None,
) -> dict[str, str]:
    """Apply the registered patches meant for ``roles`` (default: :func:`process_roles`).

    Returns ``{name: outcome}`` for the patches considered.

    Safe to call many times: a patch already applied (or skipped) in this process is not retried.
    """
    st = _STATE if state is None else state
    roles = process_roles() if roles is None else roles
    patches = PATCHES if patches is None else patches
    version = omni_version() if version is None else version
    disabled = _disabled()
    outcome: dict[str, str] = {}
    for p in patches:
        if p.where not in roles:
            continue
        if p.name in st.applied:
            outcome[p.name] = st.applied[p.name]
            continue
        if p.name in disabled or "all" in disabled:
            result = f"skipped: disabled by {DISABLE_ENV}"
            logger.warning("omni-ext patch %s %s", p.name, result)
        elif version is None:
            result = "skipped: vllm-omni is not installed"
        elif not p.applies_to(version):
            result = f"skipped: vLLM-Omni {version} is outside {p.versions}"
            if p.name not in st.warned:
                st.warned.add(p.name)
                logger.warning(
                    "omni-ext patch %s skipped: written for vLLM-Omni %s, found %s. Check whether %s "
                    "still needs it (see %s).",
                    p.name,
                    p.versions,
                    version,
                    p.target,
                    p.diff,
                )
        else:
            resolve(p.apply)()
            result = "applied"
            logger.debug("omni-ext patch %s applied to %s", p.name, p.target)
        st.applied[p.name] = result
        outcome[p.name] = result
    return outcome


# --------------------------------------------------------------------------------------------------
# For patch bodies: replace an object once, however often the body runs
# --------------------------------------------------------------------------------------------------
MARK = "_omni_ext_patched"

_T = TypeVar("_T")


def is_patched(obj: object) -> bool:
    """Whether ``obj`` is one of omni-ext's replacements (or an object a patch body already changed)."""
    return bool(getattr(obj, MARK, False))


def mark(obj: _T) -> _T:
    """Mark ``obj`` as patched by omni-ext (see :func:`is_patched`); returns it."""
    setattr(obj, MARK, True)
    return obj


def patch_attr(owner: object, name: str, new: object) -> bool:
    """``owner.name = new``, marked as omni-ext's, unless ``owner.name`` already is (then nothing).

    The registry applies each patch once per process; this keeps a body idempotent when it is called
    directly too (tests do). A function replacing a function gets ``__wrapped__`` (the stock one)
    unless it has one already (``functools.wraps``). Returns whether ``owner.name`` was replaced.
    """
    current = getattr(owner, name, None)
    if is_patched(current):
        return False
    if isinstance(new, types.FunctionType) and callable(current) and not hasattr(new, "__wrapped__"):
        new.__wrapped__ = current  # type: ignore[attr-defined]
    setattr(owner, name, mark(new))
    return True
