"""Worker-side pipeline support for the tuned executor: Wan2.1/2.2 and Qwen-Image subclasses.

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
  on CFG rank 1. Qwen-Image (one frame, nothing to pipeline): only rank 0 decodes, rank 1 returns
  as soon as the denoise loop ends and is free for the next job.
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


class TunedWan22Pipeline(_TunedCfgMixin, Wan22Pipeline):
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


# ----------------------------------------------------------------------------------------------
# Qwen-Image
# ----------------------------------------------------------------------------------------------
from vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image import (  # noqa: E402
    QwenImagePipeline,
    get_qwen_image_post_process_func,  # noqa: F401
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
            _log_split()
            n = (1 if isinstance(prompt, str) else len(prompt)) * num_images_per_prompt
            # Placeholder for the branch this rank never runs: right batch and dtype, length 1.
            return (
                torch.zeros(n, 1, 1, dtype=self.text_encoder.dtype, device=self.device),
                torch.ones(n, 1, dtype=torch.long, device=self.device),
            )
        return super().encode_prompt(
            prompt, num_images_per_prompt, prompt_embeds, prompt_embeds_mask, max_sequence_length, prompt_name
        )

    def _decode_latents(self, latents, height, width, output_type="pil"):
        if self._omx_split and ROLE.cfg_rank != 0 and output_type != "latent" and not _vae_parallel(self.od_config):
            from vllm_omni.diffusion.data import DiffusionOutput

            ROLE.owner = False
            return DiffusionOutput(output=torch.empty(latents.shape[0], 0))
        return super()._decode_latents(latents, height, width, output_type)


# vLLM-Omni's cache backends (cache-dit's model-specific enablers, the step cache, SeaCache) pick a model's
# set-up by ``type(pipeline).__name__``. A tuned subclass answers with its vLLM-Omni class's name, so that it
# gets the same set-up as that class (cache-dit's Wan2.2 enabler, not the generic one); its qualified name
# (repr, tracebacks) stays its own.
TunedWan22Pipeline.__name__ = Wan22Pipeline.__name__
TunedQwenImagePipeline.__name__ = QwenImagePipeline.__name__


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
