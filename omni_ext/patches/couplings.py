"""Every private name of vLLM-Omni that omni-ext relies on without patching it: data, checked.

The patch registry (:data:`omni_ext.patches.PATCHES`) lists what omni-ext *replaces*; this list is
what omni-ext *calls, reads, overrides or matches* among vLLM-Omni's private names (a leading
``_``, an instance attribute, a literal it sends), and the few public names it reaches in a way
that would fail silently (a guarded import, a ``getattr`` with a default). Each entry says:

- ``name``: ``module:Qualified.name`` in vLLM-Omni, or in vLLM where vLLM-Omni serves through it
  (``module:Class.attr`` for an attribute);
- ``kind``: ``function``, ``method`` (called or overridden), ``attribute`` (set on instances, e.g.
  in ``__init__``), ``constant`` (its ``value`` must not change) or ``call`` (vLLM-Omni's code at
  ``name`` must still contain the text ``value``: a behaviour omni-ext builds on);
- ``why``: what omni-ext uses it for, and what breaks when it goes;
- ``used_in``: the omni-ext module(s) that use it (separated by ``", "``), each of which must
  contain ``token`` (default: the last part of ``name``), so a refactor that moves the use must
  move the declaration too;
- ``versions``: the vLLM-Omni versions (PEP 440) it was checked against;
- ``params``: keyword/parameter names omni-ext passes or reads, which the signature must keep.

``tests/test_couplings.py`` resolves every entry against the installed vLLM-Omni (:func:`problem`),
so a vLLM-Omni release that renames one fails one clear test instead of a request at run time.
``omni-ext patches couplings [--json] [--check]`` prints the same list.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import Version

Kind = Literal["function", "method", "attribute", "constant", "call"]
KINDS: tuple[str, ...] = ("function", "method", "attribute", "constant", "call")

_SERVING_VIDEO = "vllm_omni.entrypoints.openai.serving_video:OmniOpenAIServingVideo"
_WAN = "vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2:Wan22Pipeline"
_QWEN_IMAGE = "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image:QwenImagePipeline"
_WAN_VAE = "vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_wan:DistributedAutoencoderKLWan"
_WORKER_PROC = "vllm_omni.diffusion.worker.diffusion_worker:WorkerProc"
_STAGE_POOL = "vllm_omni.engine.stage_pool:StagePool"


@dataclass(frozen=True)
class Coupling:
    name: str
    kind: Kind
    why: str
    used_in: str
    versions: str = "==0.30.0"
    params: tuple[str, ...] = ()
    value: str = ""
    token: str = ""

    @property
    def modules(self) -> tuple[str, ...]:
        """The omni-ext modules that use it (``used_in`` lists them separated by ``", "``)."""
        return tuple(m.strip() for m in self.used_in.split(", "))

    @property
    def text(self) -> str:
        """What ``used_in`` must contain for this coupling (``token``, else the name's last part)."""
        return self.token or self.name.rpartition(":")[2].rpartition(".")[2]

    def applies_to(self, version: str) -> bool:
        return Version(version) in SpecifierSet(self.versions)


def _used_together(why: str, used_in: str, *names: tuple[Any, ...]) -> tuple[Coupling, ...]:
    """Entries for several names that one omni-ext use needs together (one reason, one place):
    each ``(name, kind)`` or ``(name, kind, params)``."""
    return tuple(
        Coupling(name=n[0], kind=n[1], why=why, used_in=used_in, params=n[2] if len(n) > 2 else ()) for n in names
    )


COUPLINGS: tuple[Coupling, ...] = (
    # ---- /v1/videos (omni_ext.api.videos) --------------------------------------------------------
    Coupling(
        name=f"{_SERVING_VIDEO}._run_and_extract",
        kind="method",
        why=(
            "Runs a video generation exactly as vLLM-Omni's own /v1/videos does (defaults, LoRA, stage "
            "configs, output extraction); omni-ext adds the job store, progress and off-loop encoding "
            "around it. Without it every POST /v1/videos answers 503 video_unavailable."
        ),
        used_in="omni_ext.api.videos, omni_ext.api.state",
        params=("reference_image", "reference_video", "reference_audio", "on_started", "latent_edit_input"),
    ),
    Coupling(
        name=f"{_SERVING_VIDEO}._resolve_default_sampling_params",
        kind="method",
        why=(
            "The server's configured default sampling params (deploy YAML, --default-sampling-params), so "
            "a preset's size and frame count apply to requests that name none. Errors are swallowed: a "
            "rename would silently drop the preset's defaults."
        ),
        used_in="omni_ext.api.state",
    ),
    Coupling(
        name=f"{_SERVING_VIDEO}._video_frame_converter",
        kind="attribute",
        why=(
            "vLLM-Omni's planar frame-conversion pool, handed to _encode_video_bytes so omni-ext's MP4s are "
            "encoded as the stock route's. Read with getattr(..., None): a rename would silently fall back "
            "to the slower legacy frame path."
        ),
        used_in="omni_ext.api.videos",
    ),
    Coupling(
        name="vllm_omni.entrypoints.openai.video_api_utils:_encode_video_bytes",
        kind="function",
        why="Encodes the MP4 as the stock route does (codec options, audio mux), in omni-ext's thread pool.",
        used_in="omni_ext.api.videos",
        params=("fps", "video_codec_options", "frame_converter", "audio", "audio_sample_rate"),
    ),
    Coupling(
        name="vllm_omni.entrypoints.openai.video.generation.helpers:_reference_video_decode_spec",
        kind="function",
        why="A request's video_reference is decoded as vLLM-Omni's /v1/videos route decodes it (the frames the "
            "pipeline keeps).",
        used_in="omni_ext.api.videos",
        params=("req", "stage_configs"),
    ),
    Coupling(
        name="vllm_omni.entrypoints.openai.video.generation.helpers:_cleanup_video_references",
        kind="function",
        why=(
            "Removes the temporary files of a request's reference video and audio, its control_reference and its "
            "latent-edit sources when the generation ends (omni_ext.api.intake.Uploads.cleanup), as vLLM-Omni's "
            "own route does; without it every such request would leave its files in the temp directory."
        ),
        used_in="omni_ext.api.videos, omni_ext.api.intake",
        params=("reference_video", "reference_audio", "control_path", "latent_edit_input"),
    ),
    *_used_together(
        "The uploads of /v1/videos beside input_reference (input_references, control_reference with control_type, "
        "latent-mask editing's source_video, source_audio, video_noise_mask, audio_noise_mask) are checked and "
        "persisted by vLLM-Omni's own route helpers (omni_ext.api.intake.with_uploads), so that omni-ext's route "
        "takes, refuses (status and message) and hands over to the generation call exactly what vLLM-Omni's "
        "own route does. Without them every such upload would be refused.",
        "omni_ext.api.intake",
        ("vllm_omni.entrypoints.openai.video.generation.helpers:_read_latent_edit_mask_json", "function",
         ("value", "field_name")),
        ("vllm_omni.entrypoints.openai.video.generation.helpers:_validate_latent_edit_inputs", "function",
         ("handler", "source_video", "source_audio", "video_noise_mask", "audio_noise_mask")),
        ("vllm_omni.entrypoints.openai.video.generation.helpers:_validate_control_upload", "function",
         ("handler", "request", "control_reference", "control_type")),
        ("vllm_omni.entrypoints.openai.video.generation.helpers:_attach_control_upload", "function",
         ("request", "control_type", "control_path")),
        ("vllm_omni.entrypoints.openai.video.generation.helpers:_persist_uploaded_video_references", "function",
         ("uploads",)),
        ("vllm_omni.entrypoints.openai.video.generation.helpers:_persist_uploaded_media_references", "function",
         ("uploads",)),
        ("vllm_omni.entrypoints.openai.video.generation.helpers:_persist_uploaded_control_reference", "function",
         ("upload",)),
        ("vllm_omni.entrypoints.openai.video.generation.helpers:_persist_latent_edit_source", "function",
         ("upload", "field_name")),
    ),
    # ---- /v1/images (omni_ext.api.images) --------------------------------------------------------
    *_used_together(
        "vLLM-Omni's image generation call (stage configs, engine errors) and the extraction of the PIL images "
        "from its result, so /v1/images/generations generates exactly as the stock route.",
        "omni_ext.api.images",
        ("vllm_omni.entrypoints.openai.diffusion:_generate_with_async_omni", "function",
         ("engine_client", "gen_params", "stage_configs", "prompt", "request_id")),
        ("vllm_omni.entrypoints.openai.images.helpers:_extract_images_from_result", "function"),
    ),
    # ---- tuned pipelines (omni_ext.executor.pipelines) -------------------------------------------
    *_used_together(
        "The single-rank and pair CFG steps normalise and slice noise predictions as vLLM-Omni's CFG-parallel step does.",
        "omni_ext.executor.pipelines",
        ("vllm_omni.diffusion.distributed.cfg_parallel:_wrap", "function"),
        ("vllm_omni.diffusion.distributed.cfg_parallel:_slice_pred", "function"),
    ),
    *_used_together(
        "The request's resolved guidance scales (Wan2.2: one per expert): a CFG pair splits text encoding only "
        "when every step runs CFG.",
        "omni_ext.executor.pipelines",
        (f"{_WAN}._guidance_scale", "attribute"),
        (f"{_WAN}._guidance_scale_2", "attribute"),
    ),
    Coupling(
        name=f"{_WAN_VAE}.decode",
        kind="method",
        why=(
            "Replaced on each Wan pipeline's vae *instance* (vae.decode = ...) in TunedExecutor workers, to "
            "split the decode between the two CFG ranks (omni_ext.executor.vae_pipeline); the replacement "
            "keeps decode(z, return_dict)."
        ),
        used_in="omni_ext.executor.pipelines",
        params=("z", "return_dict"),
        token="vae.decode",
    ),
    Coupling(
        name="vllm.entrypoints.launchers.launcher:serve_http",
        kind="call",
        why=(
            "On SIGTERM vLLM's serve_http stops the engine client (engine_client.shutdown, in a thread) before "
            "the HTTP server; omni-ext's drain runs in front of that call (an instance attribute on the engine "
            "client, omni_ext.api.drain.install). Were the call to go, a SIGTERM would stop the server without "
            "draining, and queued jobs would still be kept for the next start."
        ),
        used_in="omni_ext.api.drain",
        value="engine_client.shutdown",
        token="shutdown",
    ),
    Coupling(
        name=_WAN,
        kind="call",
        why=(
            "The instance-level vae.decode replacement takes effect only while the pipeline decodes "
            "through self.vae.decode (not another decode entry point)."
        ),
        used_in="omni_ext.executor.pipelines",
        value="self.vae.decode(",
        token="vae.decode",
    ),
    Coupling(
        name=f"{_WAN_VAE}._execution_context",
        kind="method",
        why=(
            "The split VAE decode runs under the VAE's own execution context (dtype, autocast) as the stock "
            "decode does. Guarded by hasattr: a rename would silently fall back to torch.no_grad()."
        ),
        used_in="omni_ext.executor.pipelines",
    ),
    *_used_together(
        "Overridden by TunedQwenImagePipeline: _prepare_generation_context to learn, before encode_prompt runs, "
        "whether the request runs both CFG branches (split text encoding on a CFG pair); _decode_latents so "
        "CFG rank 1 of a pair skips the VAE decode (rank 0 returns the image) and is free sooner.",
        "omni_ext.executor.pipelines",
        (f"{_QWEN_IMAGE}._prepare_generation_context", "method",
         ("negative_prompt", "negative_prompt_embeds", "negative_prompt_embeds_mask", "true_cfg_scale")),
        (f"{_QWEN_IMAGE}._decode_latents", "method", ("latents", "height", "width", "output_type")),
    ),
    Coupling(
        name="vllm_omni.diffusion.utils.prompt_utils:validate_prompt_sequence_lengths",
        kind="function",
        why=(
            "A split CFG rank of the tuned Qwen-Image(-Edit) pipelines holds the branch it does not encode to "
            "the same token bound, with the pipeline's own prompt_template_encode, tokenizer and "
            "tokenizer_max_length, so an over-long prompt fails on both ranks and never leaves one waiting in "
            "the all-gather."
        ),
        used_in="omni_ext.executor.pipelines",
        params=("attention_mask", "max_sequence_length", "supported_max_sequence_length", "prompt_name",
                "baseline_attention_mask", "error_context"),
    ),
    *(
        coupling
        for edit in ("vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit:QwenImageEditPipeline",
                     "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus:QwenImageEditPlusPipeline")
        for coupling in (
            *_used_together(
                "Overridden by the tuned Qwen-Image-Edit pipelines, whose forward runs the whole request: "
                "check_cfg_parallel_validity, which forward calls with its do_true_cfg inputs before it encodes the "
                "prompts, tells a CFG pair whether it splits the text encoding; encode_prompt then encodes only "
                "this rank's branch, told apart by prompt_name (forward names the negative one). If forward stops "
                "calling the check, a pair encodes both branches and both ranks decode (slower, same image).",
                "omni_ext.executor.pipelines",
                (f"{edit}.check_cfg_parallel_validity", "method", ("true_cfg_scale", "has_neg_prompt")),
                (f"{edit}.encode_prompt", "method",
                 ("prompt", "image", "num_images_per_prompt", "prompt_embeds", "prompt_embeds_mask",
                  "max_sequence_length", "prompt_name")),
            ),
            Coupling(
                name=f"{edit}.forward", kind="call", used_in="omni_ext.executor.pipelines",
                why="encode_prompt's split tells the branches apart by the name forward gives the negative one; "
                    "without it CFG rank 1 would run its branch on a placeholder.",
                value='prompt_name="negative_prompt"', token='"negative_prompt"',
            ),
            Coupling(
                name=edit, kind="call", used_in="omni_ext.executor.pipelines", token="vae.decode",
                why="CFG rank 1 of a split pair skips the VAE decode through the vae.decode replaced on the VAE "
                    "instance; it takes effect only while forward decodes through self.vae.decode.",
                value="self.vae.decode(",
            ),
        )
    ),
    Coupling(
        name="vllm_omni.diffusion.distributed.autoencoders.wan_vae_fastpath:is_installed",
        kind="function",
        why=(
            "The split VAE decode reproduces the stock decode and must step aside when vLLM-Omni's CUDA fast "
            "path is installed on the VAE. Imported under try/except: a rename would silently split a "
            "fast-path decode."
        ),
        used_in="omni_ext.executor.vae_pipeline",
    ),
    # ---- vLLM-Omni's registry and model facts (omni_ext.models.registry) --------------------------
    *_used_together(
        "The pipelines vLLM-Omni registers, the class it loads for each key, and the classes cache "
        "acceleration cannot serve: omni-ext reads every model fact from these (omni-ext models, the routes, "
        "the TunedExecutor's hand-off to vLLM-Omni's executor) instead of keeping its own list of names.",
        "omni_ext.models.registry",
        ("vllm_omni.diffusion.registry:_DIFFUSION_MODELS", "attribute"),
        ("vllm_omni.diffusion.registry:_NO_CACHE_ACCELERATION", "attribute"),
        ("vllm_omni.diffusion.registry:DiffusionModelRegistry._try_load_model_cls", "method"),
    ),
    *_used_together(
        "vLLM-Omni's own answers for a class: what it makes (video/image/audio), its reference inputs; read with "
        "getattr where the class declares them (supports_request_batch, supports_request_cancellation, "
        "support_image_input), so a rename reads False and omni-ext falls back to vLLM-Omni's own executor.",
        "omni_ext.models.registry",
        ("vllm_omni.diffusion.io_support:get_diffusion_output_type", "function"),
        ("vllm_omni.diffusion.model_metadata:get_diffusion_model_metadata", "function"),
        ("vllm_omni.diffusion.distributed.cfg_parallel:CFGParallelMixin", "function"),
    ),
    Coupling(
        name="vllm_omni.diffusion.cache.cachedit.backend:CacheDiTBackend.enable",
        kind="call",
        why=(
            "cache-dit picks a model's set-up by the pipeline's class name; the tuned pipelines take their "
            "vLLM-Omni class's __name__ (omni_ext.executor.pipelines) so they get the same Wan2.2 enabler. If the "
            "lookup changes, the tuned Wan silently falls back to cache-dit's generic adapter."
        ),
        used_in="omni_ext.executor.pipelines",
        value="type(pipeline).__name__",
        token="__name__",
    ),
    # ---- TunedExecutor (omni_ext.executor.tuned) -------------------------------------------------
    Coupling(
        name="vllm_omni.diffusion.executor.abstract:DiffusionExecutor._init_executor",
        kind="method",
        why="The executor's start-up hook (abstract, called by DiffusionExecutor.__init__): TunedExecutor starts its workers there.",
        used_in="omni_ext.executor.tuned",
    ),
    Coupling(
        name="vllm_omni.diffusion.request:DUMMY_DIFFUSION_REQUEST_ID",
        kind="constant",
        why=(
            "TunedExecutor recognises vLLM-Omni's start-up warm-up request by this request-id prefix and runs "
            "it on every worker (at 64 px on a CPU host). A new id would warm one worker only, and at full size."
        ),
        used_in="omni_ext.scheduler.queue",
        value="dummy_req_id",
        token='"dummy_req_id"',
    ),
    Coupling(
        name="vllm_omni.diffusion.diffusion_engine:DiffusionEngine._make_dummy_request",
        kind="call",
        why="The warm-up request the engine sends at start-up still carries DUMMY_DIFFUSION_REQUEST_ID (see above).",
        used_in="omni_ext.scheduler.queue",
        value="request_id=DUMMY_DIFFUSION_REQUEST_ID",
        token='"dummy_req_id"',
    ),
    # ---- patch bodies: private names they use besides the objects they replace -------------------
    Coupling(
        name="vllm_omni.entrypoints.serve.utils.routes:_remove_route_from_router",
        kind="function",
        why="openai-routes removes vLLM-Omni's /v1/videos and /v1/images routes from the module router with it.",
        used_in="omni_ext.patches.openai_routes",
        params=("router", "path", "methods"),
    ),
    Coupling(
        name="vllm_omni.diffusion.models.progress_bar:_is_rank_zero",
        kind="function",
        why="step-progress: outside the TunedExecutor, the rank that reports progress is vLLM-Omni's rank 0.",
        used_in="omni_ext.patches.step_progress",
    ),
    *_used_together(
        "The async-output-no-accelerator loop replaces WorkerProc._async_output_loop and must drain the same "
        "queue, send through the same result channel and count down the same pending counter.",
        "omni_ext.patches.async_output",
        (f"{_WORKER_PROC}._async_output_queue", "attribute"),
        (f"{_WORKER_PROC}._enqueue_result", "method"),
        (f"{_WORKER_PROC}._async_output_done", "attribute"),
        (f"{_WORKER_PROC}._async_output_pending", "attribute"),
    ),
    *_used_together(
        "replica-dispatch binds a queued request through the pool's own tables (so vLLM-Omni's abort routing, "
        "CFG-companion affinity and replica-loss clean-up see it), finds the serviceable replicas as pick() does, "
        "sends through the replica's diffusion client, and fails a request it cannot place the way the "
        "orchestrator fails one for a dead stage.",
        "omni_ext.dispatch.replicas",
        (f"{_STAGE_POOL}._request_bindings", "attribute"),
        (f"{_STAGE_POOL}._affinity", "attribute"),
        (f"{_STAGE_POOL}._addr_to_replica_id", "attribute"),
        (f"{_STAGE_POOL}._collect_serviceable_replicas", "method"),
        (f"{_STAGE_POOL}._client_input_addr", "method"),
        (f"{_STAGE_POOL}._diffusion_client", "method"),
        ("vllm_omni.engine.orchestrator:Orchestrator._fail_request_dead_stage", "method", ("req_id", "stage_id")),
    ),
    Coupling(
        name="vllm_omni.engine.orchestrator:OrchestratorBase.request_states",
        kind="attribute",
        why=("The idle-poll-backoff patch takes its deep idle cadence (100 ms polls) only while every orchestrator's "
             "request_states is empty: nothing in flight. Read with getattr: a rename makes every poll take the "
             "10 ms cadence (safe, but an idle server then takes 2.5 % of a core again)."),
        used_in="omni_ext.patches.idle_poll",
    ),
    Coupling(
        name="vllm_omni.diffusion.forward_context:_forward_context",
        kind="attribute",
        why=("Step-level preemption saves vLLM-Omni's forward context (a module global) when a job pauses and "
             "puts it back when it resumes, after another job ran in between; a rename would leave a resumed "
             "job with the other job's context."),
        used_in="omni_ext.executor.suspend",
    ),
    *(
        Coupling(name=name, kind="attribute", used_in="omni_ext.executor.worker",
                 why=("A paused job's thread finds the pipeline whose per-request state it saves, and the "
                      "device its new thread must make current, through these (read with getattr: a rename "
                      "would silently skip the save)."))
        for name in ("vllm_omni.diffusion.worker.diffusion_worker:DiffusionWorker.model_runner",
                     "vllm_omni.diffusion.worker.diffusion_worker:DiffusionWorker.device",
                     "vllm_omni.diffusion.worker.diffusion_model_runner:DiffusionModelRunner.pipeline")
    ),
    Coupling(
        name="vllm_omni.diffusion.data:OmniDiffusionConfig.cache_backend",
        kind="attribute",
        why=("The TunedExecutor refuses step-level preemption under a cache backend (its per-request cache is "
             "not saved at a pause); read with getattr: a rename would silently allow it."),
        used_in="omni_ext.executor.tuned",
    ),
    Coupling(
        name="vllm_omni.diffusion.stage_diffusion_client:StageDiffusionClient._request_socket",
        kind="attribute",
        why="replica-send-nonblocking wraps the head's request socket to a replica so that its sends cannot block.",
        used_in="omni_ext.patches.replica_send",
    ),
    Coupling(
        name="vllm_omni.config.omni_config:_DiffusionEngineOverrides.to_kwargs",
        kind="method",
        why="dp-world reads the stage's merged additional_config from the diffusion projection of its engine values.",
        used_in="omni_ext.patches.dp_world",
    ),
    Coupling(
        name="vllm_omni.engine.stage_init_utils:build_diffusion_config",
        kind="call",
        why=(
            "dp-world relies on vLLM-Omni's own start-up check of the stage's world (with omni-ext's data "
            "parallelism in it) against the visible devices; without it a layout too big for the host "
            "would reach the TunedExecutor's own check only."
        ),
        used_in="omni_ext.patches.dp_world",
        value="num_devices_per_stage = od_config.parallel_config.world_size",
        token="build_diffusion_config",
    ),
    Coupling(
        name="vllm_omni.diffusion.distributed.parallel_state:_initialize_model_parallel",
        kind="call",
        why=(
            "The TunedExecutor's sequence-parallel units (omni_ext.scheduler.placement.Units) are vLLM-Omni's SP "
            "groups only because vLLM-Omni orders ranks tp-sp-pp-cfg-dp: unit u is processes [u*sp, (u+1)*sp), "
            "a CFG group pairs the same place of two units. Another order would send a job to processes of "
            "different SP groups."
        ),
        used_in="omni_ext.scheduler.placement",
        value='order="tp-sp-pp-cfg-dp"',
        token='"tp-sp-pp-cfg-dp"',
    ),
    # ---- TunedExecutor outputs through shared memory (omni_ext.executor.protocol) -----------------
    *_used_together(
        "A job's output leaves a TunedExecutor worker in vLLM-Omni's shared-memory segment format: its "
        "pack_diffusion_output_shm moves the large tensors, these move the small ones too (so no tensor "
        "crosses the pipe) and unlink what a failed packing made; unpack_diffusion_output_shm reads them all.",
        "omni_ext.executor.protocol",
        ("vllm_omni.diffusion.ipc:_tensor_to_shm", "function", ("tensor", "created")),
        ("vllm_omni.diffusion.ipc:_ndarray_to_shm", "function", ("array", "created")),
        ("vllm_omni.diffusion.ipc:_unlink_shm_handles", "function", ("handles",)),
    ),
    *(
        Coupling(
            name=f"vllm_omni.diffusion.ipc:{reader}",
            kind="call",
            why=(
                f"omni_ext.executor.protocol leaves a dict marked {marker!r} untouched as an already packed "
                "segment; vLLM-Omni's unpacking must still recognise it by that key."
            ),
            used_in="omni_ext.executor.protocol",
            value=f'"{marker}"',
            token=f'"{marker}"',
        )
        for reader, marker in (("_unpack_if_shm_handle", "__tensor_shm__"), ("_ndarray_to_shm", "__ndarray_shm__"))
    ),
)


def problem(c: Coupling) -> str | None:
    """Why ``c`` does not hold in the installed vLLM-Omni, or None when it does (imports vLLM-Omni)."""
    module, _, qual = c.name.partition(":")
    owner_qual, _, attr = qual.rpartition(".")
    try:
        owner: Any = importlib.import_module(module)
        for part in owner_qual.split(".") if owner_qual else ():
            owner = getattr(owner, part)
    except (ImportError, AttributeError) as exc:
        return f"{module}:{owner_qual or attr} is gone ({type(exc).__name__}: {exc})"
    if c.kind == "attribute":
        if hasattr(owner, attr) or any(_assigns(cls, attr) for cls in inspect.getmro(owner)):
            return None
        return f"{c.name}: no class attribute and no 'self.{attr} = ...' in {owner.__name__} or its bases"
    if not hasattr(owner, attr):
        return f"{c.name} is gone"
    obj = getattr(owner, attr)
    if c.kind == "constant":
        return None if obj == c.value else f"{c.name} is {obj!r}; omni-ext expects {c.value!r}"
    if c.kind == "call":
        return None if c.value in inspect.getsource(obj) else f"{c.name} no longer contains {c.value!r}"
    if not callable(obj):
        return f"{c.name} is no longer callable ({type(obj).__name__})"
    return _missing_params(obj, c.params, c.name) if c.params else None


def _assigns(cls: type, attr: str) -> bool:
    """Whether the source of ``cls`` (its own body, not its bases) assigns ``self.<attr>``."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"\bself\.{re.escape(attr)}\s*(:[^=\n]*)?=(?!=)", source) is not None


def _missing_params(obj: Any, params: tuple[str, ...], name: str) -> str | None:
    """Which of ``params`` the signature of ``obj`` no longer accepts (``**kwargs`` accepts all)."""
    sig = inspect.signature(obj)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    missing = [p for p in params if p not in sig.parameters]
    return f"{name}{sig} lacks parameter(s) {', '.join(missing)}" if missing else None
