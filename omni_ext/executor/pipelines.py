"""Worker-side pipeline support for the tuned executor: Wan2.1/2.2 (text- and image-to-video) and Qwen-Image subclasses.

They are registered (vLLM-Omni's ``register_diffusion_model``, same architecture key, the names
:func:`omni_ext.models.families.tuned_pipelines` lists) only inside the tuned executor's worker
processes, so every other server, and the engine/API process, keeps vLLM-Omni's classes. Outside
a CFG pair job (:func:`omni_ext.executor.role.pair_active`) they compute exactly what the parent
classes compute on one device: a request that runs CFG on ONE rank of a CFG group (the scheduler's
``cfg_mode`` "single", or "adaptive" under load) encodes both prompts, runs both guidance branches
in turn on that rank without any collective, and decodes the whole output there (the same bytes as
one device). Inside a pair job:

- Text encoding: CFG rank 0 encodes only the prompt, rank 1 only the negative prompt. The other
  branch gets a placeholder of the right batch/dtype that is never fed to the transformer (in CFG
  parallel each rank runs only its own branch). Wan does this only when every step runs CFG.
- Denoising: unchanged, vLLM-Omni's one all-gather of the noise prediction per step.
- Wan VAE decode: divided between the ranks (:mod:`omni_ext.executor.vae_pipeline`); the video ends
  on CFG rank 1. Qwen-Image and Qwen-Image-Edit(-Plus) (one frame, nothing to pipeline): only rank 0
  decodes, rank 1 returns as soon as the denoise loop ends and is free for the next job.
"""

from __future__ import annotations

import logging

import torch

from omni_ext.executor.role import ROLE, pair_active
from omni_ext.scheduler.placement import JobMode

logger = logging.getLogger("omni_ext.executor")

_REGISTERED: list[str] | None = None
_LOGGED: set[str] = set()


def _log_once(msg: str) -> None:
    if msg not in _LOGGED:
        _LOGGED.add(msg)
        logger.info(msg)


def _log_split() -> None:
    _log_once(
        f"omni-ext: CFG rank {ROLE.cfg_rank} encodes only the {'prompt' if ROLE.cfg_rank == 0 else 'negative prompt'}"
    )


def _vae_parallel(od_config) -> bool:
    pc = getattr(od_config, "parallel_config", None)
    return int(getattr(pc, "vae_patch_parallel_size", 1) or 1) > 1


class _TunedCfgMixin:
    """How the tuned pipelines run guidance, for both job modes the executor places
    (:class:`~omni_ext.scheduler.placement.JobMode`): one rank alone, or a CFG pair that can be cancelled.

    vLLM-Omni picks the parallel path whenever the CFG group has 2 ranks; a SINGLE job (one rank
    of a CFG group, its partner busy with another request) must never enter the group's
    all-gather, so it runs both branches sequentially on its rank.

    A PAIR job runs vLLM-Omni's CFG-parallel step unchanged (each rank its own branch, its one
    all-gather, the same combine on both ranks). Before each step both ranks consult the executor's
    shared board (:func:`omni_ext.executor.role.stop_now`): a cancellation stops both at the
    same step boundary, and a pause (step-level preemption) holds both there until the job resumes,
    with no extra collective and no host synchronization per step.

    vLLM-Omni's own cooperative cancellation (``supports_request_cancellation``) is off here: its
    per-step check is an all-reduce over the WORLD group, which cannot work when ranks run
    different requests, and would be a second collective per step. Cancellation is the
    executor's instead (:mod:`omni_ext.executor.role`).
    """

    supports_request_cancellation = False

    def predict_noise_maybe_with_cfg(
        self, do_true_cfg, true_cfg_scale, positive_kwargs, negative_kwargs,
        cfg_normalize=True, output_slice=None, kwargs=None,
    ):
        extra = {} if kwargs is None else {"kwargs": kwargs}
        if do_true_cfg and ROLE.mode == JobMode.SINGLE and ROLE.cfg_size > 1:
            from vllm_omni.diffusion.distributed.cfg_parallel import _slice_pred, _wrap

            pos = _wrap(self.predict_noise(**positive_kwargs))
            neg = _wrap(self.predict_noise(**negative_kwargs))
            if output_slice is not None:
                pos, neg = _slice_pred(pos, output_slice), _slice_pred(neg, output_slice)
            return self.combine_cfg_noise(pos, neg, true_cfg_scale, cfg_normalize, **extra)
        if do_true_cfg and pair_active():
            return self._pair_step(true_cfg_scale, positive_kwargs, negative_kwargs, cfg_normalize, output_slice, extra)
        legacy = () if kwargs is None else (kwargs,)  # Wan's PipelineParallelMixin takes no `kwargs`
        return super().predict_noise_maybe_with_cfg(
            do_true_cfg, true_cfg_scale, positive_kwargs, negative_kwargs, cfg_normalize, output_slice, *legacy
        )

    def _pair_step(self, true_cfg_scale, positive_kwargs, negative_kwargs, cfg_normalize, output_slice, extra):
        from omni_ext.executor.role import aborted, stop_now

        if stop_now():
            raise aborted("Request cancelled at a denoise step (both CFG ranks stopped together)")
        legacy = tuple(extra.values())  # Wan's PipelineParallelMixin takes no `kwargs`
        return super().predict_noise_maybe_with_cfg(
            True, true_cfg_scale, positive_kwargs, negative_kwargs, cfg_normalize, output_slice, *legacy
        )


# ----------------------------------------------------------------------------------------------
# Wan
# ----------------------------------------------------------------------------------------------
from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import (  # noqa: E402
    Wan22Pipeline,
    get_wan22_post_process_func,  # noqa: F401  (the registry resolves process funcs in this module)
    get_wan22_pre_process_func,  # noqa: F401
)


class _TunedWanMixin(_TunedCfgMixin):
    """The Wan split, shared by text-to-video (``Wan22Pipeline``, also TI2V-5B's image mode) and
    image-to-video (``Wan22I2VPipeline``): both encode text with the same ``encode_prompt``, set
    ``_guidance_scale``/``_guidance_scale_2`` before encoding, and decode with ``vae.decode``.

    The image conditioning of image-to-video (the VAE encode of the reference, CLIP embeddings for
    Wan2.1 I2V) feeds both guidance branches identically, so each CFG rank computes it for itself:
    sending it from one rank would cost a transfer of the same size as the work it saves.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vae = getattr(self, "vae", None)
        if vae is not None and not _vae_parallel(self.od_config):
            stock_decode = vae.decode

            def decode(z, return_dict: bool = True):
                from omni_ext.executor import vae_pipeline

                if not pair_active() or not vae_pipeline.can_pipeline(vae, z):
                    return stock_decode(z, return_dict=return_dict)
                ctx = vae._execution_context() if hasattr(vae, "_execution_context") else torch.no_grad()
                with ctx:
                    out = vae_pipeline.pipelined_decode(vae, z, ROLE.cfg_rank)
                ROLE.owner = ROLE.cfg_rank == 1
                if out is None:  # rank 0: the video is on rank 1; hand the pipeline a placeholder
                    out = torch.empty(z.shape[0], 0, device=z.device)
                if return_dict:
                    from diffusers.models.autoencoders.vae import DecoderOutput

                    return DecoderOutput(sample=out)
                return (out,)

            vae.decode = decode

    def _split_encode(self) -> bool:
        g1, g2 = self._guidance_scale, self._guidance_scale_2
        return pair_active() and g1 is not None and g2 is not None and float(g1) > 1.0 and float(g2) > 1.0

    def encode_prompt(
        self,
        prompt,
        negative_prompt=None,
        do_classifier_free_guidance: bool = True,
        num_videos_per_prompt: int = 1,
        max_sequence_length: int = 512,
        device=None,
        dtype=None,
    ):
        if not (do_classifier_free_guidance and self._split_encode()):
            return super().encode_prompt(
                prompt, negative_prompt, do_classifier_free_guidance, num_videos_per_prompt,
                max_sequence_length, device, dtype,
            )
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        _log_split()
        if ROLE.cfg_rank == 0:
            own, _ = super().encode_prompt(prompts, None, False, num_videos_per_prompt, max_sequence_length, device, dtype)
            return own, torch.zeros_like(own)  # never used: rank 0 runs only the positive branch
        neg = negative_prompt or ""
        negs = len(prompts) * [neg] if isinstance(neg, str) else list(neg)
        own, _ = super().encode_prompt(negs, None, False, num_videos_per_prompt, max_sequence_length, device, dtype)
        return torch.zeros_like(own), own  # never used: rank 1 runs only the negative branch


class TunedWan22Pipeline(_TunedWanMixin, Wan22Pipeline):
    pass


from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2_i2v import (  # noqa: E402
    Wan22I2VPipeline,
    get_wan22_i2v_post_process_func,  # noqa: F401
    get_wan22_i2v_pre_process_func,  # noqa: F401
)


class TunedWan22I2VPipeline(_TunedWanMixin, Wan22I2VPipeline):
    pass


# ----------------------------------------------------------------------------------------------
# Qwen-Image
# ----------------------------------------------------------------------------------------------
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import (  # noqa: E402
    QwenImagePipeline,
    get_qwen_image_post_process_func,  # noqa: F401
)


def _qwen_placeholder(pipe, prompt, num_images_per_prompt: int, max_sequence_length: int | None, prompt_name: str):
    """What a split CFG rank's Qwen-Image(-Edit) ``encode_prompt`` returns for the branch it never runs: a
    placeholder of the right batch and dtype, length 1. The branch's prompt is still held to vLLM-Omni's
    token bound (the same check, on the tokenizer alone): were only its own rank to refuse an over-long
    prompt, the partner would wait for it in the next all-gather for good."""
    from vllm_omni.diffusion.utils.prompt_utils import validate_prompt_sequence_lengths

    _log_split()
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    template = pipe.prompt_template_encode
    tokens = pipe.tokenizer([template.format(p) for p in prompts], padding=True, truncation=False, return_tensors="pt")
    baseline = pipe.tokenizer([template.format("")], padding=True, truncation=False, return_tensors="pt")
    validate_prompt_sequence_lengths(
        tokens.attention_mask, max_sequence_length=max_sequence_length or pipe.tokenizer_max_length,
        supported_max_sequence_length=pipe.tokenizer_max_length, prompt_name=prompt_name,
        baseline_attention_mask=baseline.attention_mask, error_context="after applying the Qwen prompt template",
    )
    n = len(prompts) * num_images_per_prompt
    return (
        torch.zeros(n, 1, 1, dtype=pipe.text_encoder.dtype, device=pipe.device),
        torch.ones(n, 1, dtype=torch.long, device=pipe.device),
    )


class TunedQwenImagePipeline(_TunedCfgMixin, QwenImagePipeline):
    _omx_split = False

    def forward(self, req):
        self._omx_split = False
        try:
            return super().forward(req)
        finally:
            self._omx_split = False

    def _prepare_generation_context(self, **kwargs):
        has_neg = kwargs.get("negative_prompt") is not None or (
            kwargs.get("negative_prompt_embeds") is not None and kwargs.get("negative_prompt_embeds_mask") is not None
        )
        self._omx_split = pair_active() and float(kwargs.get("true_cfg_scale") or 0) > 1 and has_neg
        return super()._prepare_generation_context(**kwargs)

    def encode_prompt(
        self,
        prompt,
        num_images_per_prompt: int = 1,
        prompt_embeds=None,
        prompt_embeds_mask=None,
        max_sequence_length: int = 1024,
        prompt_name: str = "prompt",
    ):
        mine = "prompt" if ROLE.cfg_rank == 0 else "negative_prompt"
        if self._omx_split and prompt_embeds is None and prompt_name != mine:
            return _qwen_placeholder(self, prompt, num_images_per_prompt, max_sequence_length, prompt_name)
        return super().encode_prompt(
            prompt, num_images_per_prompt, prompt_embeds, prompt_embeds_mask, max_sequence_length, prompt_name
        )

    def _decode_latents(self, latents, height, width, output_type="pil"):
        if self._omx_split and ROLE.cfg_rank != 0 and output_type != "latent" and not _vae_parallel(self.od_config):
            from vllm_omni.diffusion.data import DiffusionOutput

            ROLE.owner = False
            return DiffusionOutput(output=torch.empty(latents.shape[0], 0))
        return super()._decode_latents(latents, height, width, output_type)


# ----------------------------------------------------------------------------------------------
# Qwen-Image-Edit (-2509/-2511: Plus)
# ----------------------------------------------------------------------------------------------
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit import (  # noqa: E402
    QwenImageEditPipeline,
    get_qwen_image_edit_post_process_func,  # noqa: F401
    get_qwen_image_edit_pre_process_func,  # noqa: F401
)
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus import (  # noqa: E402
    QwenImageEditPlusPipeline,
    get_qwen_image_edit_plus_post_process_func,  # noqa: F401
    get_qwen_image_edit_plus_pre_process_func,  # noqa: F401
)


class _TunedQwenImageEditMixin(_TunedCfgMixin):
    """The Qwen-Image split for the edit pipelines, whose one ``forward`` runs the whole request; the
    hooks are where it calls out:

    - ``check_cfg_parallel_validity(true_cfg_scale, has_neg_prompt)``: ``forward`` calls it with the
      inputs of its own ``do_true_cfg`` just before it encodes the prompts, so this is where a pair
      job learns whether it splits.
    - ``encode_prompt``: the Qwen2.5-VL encoder reads the prompt together with the reference image(s);
      in a split pair each rank encodes only its own branch, the other gets a placeholder.
    - The reference image's VAE latents (``prepare_latents``, unchanged) condition both branches
      identically, so both ranks compute them: sending them from one rank would cost about what
      encoding them does.
    - ``self.vae.decode`` (inline in ``forward``): wrapped on the VAE instance, so CFG rank 1 of a split
      pair returns an empty output instead of decoding; rank 0 decodes and returns the image.
    """

    _omx_split = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vae = getattr(self, "vae", None)
        if vae is None:
            return
        stock_decode = vae.decode

        def decode(z, return_dict: bool = True):
            if not (self._omx_split and ROLE.cfg_rank != 0 and not _vae_parallel(self.od_config)):
                return stock_decode(z, return_dict=return_dict)
            ROLE.owner = False
            # (batch, 0 channels, frames, h, w): nothing allocated, and forward's [:, :, 0] still applies.
            out = torch.empty(z.shape[0], 0, *z.shape[2:], dtype=z.dtype, device=z.device)
            if return_dict:
                from diffusers.models.autoencoders.vae import DecoderOutput

                return DecoderOutput(sample=out)
            return (out,)

        vae.decode = decode

    def forward(self, req):
        self._omx_split = False
        try:
            return super().forward(req)
        finally:
            self._omx_split = False

    def check_cfg_parallel_validity(self, true_cfg_scale: float, has_neg_prompt: bool):
        self._omx_split = pair_active() and true_cfg_scale > 1 and bool(has_neg_prompt)
        return super().check_cfg_parallel_validity(true_cfg_scale, has_neg_prompt)

    def encode_prompt(
        self,
        prompt,
        image=None,
        num_images_per_prompt: int = 1,
        prompt_embeds=None,
        prompt_embeds_mask=None,
        max_sequence_length: int = 1024,
        prompt_name: str = "prompt",
    ):
        mine = "prompt" if ROLE.cfg_rank == 0 else "negative_prompt"
        if self._omx_split and prompt_embeds is None and prompt_name != mine:
            return _qwen_placeholder(self, prompt, num_images_per_prompt, max_sequence_length, prompt_name)
        return super().encode_prompt(
            prompt, image=image, num_images_per_prompt=num_images_per_prompt, prompt_embeds=prompt_embeds,
            prompt_embeds_mask=prompt_embeds_mask, max_sequence_length=max_sequence_length, prompt_name=prompt_name,
        )


class TunedQwenImageEditPipeline(_TunedQwenImageEditMixin, QwenImageEditPipeline):
    pass


class TunedQwenImageEditPlusPipeline(_TunedQwenImageEditMixin, QwenImageEditPlusPipeline):
    pass


# vLLM-Omni's cache backends (cache-dit's model-specific enablers, the step cache, SeaCache) pick a model's
# set-up by ``type(pipeline).__name__``. A tuned subclass answers with its vLLM-Omni class's name, so that it
# gets the same set-up as that class (cache-dit's Wan2.2 enabler, not the generic one); its qualified name
# (repr, tracebacks) stays its own.
TunedWan22Pipeline.__name__ = Wan22Pipeline.__name__
TunedWan22I2VPipeline.__name__ = Wan22I2VPipeline.__name__
TunedQwenImagePipeline.__name__ = QwenImagePipeline.__name__
TunedQwenImageEditPipeline.__name__ = QwenImageEditPipeline.__name__
TunedQwenImageEditPlusPipeline.__name__ = QwenImageEditPlusPipeline.__name__


def register_tuned_pipelines() -> list[str]:
    """Point vLLM-Omni's registry at the tuned classes (call only in tuned worker processes).

    Registers each pipeline name of :func:`omni_ext.models.families.tuned_pipelines` that vLLM-Omni's
    registry itself knows (it looks a model up by exactly these names); a family's other names
    would be new architectures without vLLM-Omni's pre/post-processing. Returns the names registered.
    """
    global _REGISTERED
    from vllm_omni.diffusion.registry import DiffusionModelRegistry, register_diffusion_model

    from omni_ext.models.families import tuned_pipelines

    if _REGISTERED is None:
        known = DiffusionModelRegistry.get_supported_archs()
        tuned = {name: qualname for name, qualname in tuned_pipelines().items() if name in known}
        for name, qualname in tuned.items():
            module, _, cls = qualname.partition(":")
            register_diffusion_model(name, module, cls)
        _REGISTERED = list(tuned)
    return list(_REGISTERED)
