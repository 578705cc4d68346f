"""Registered pipeline topologies that let a deploy YAML configure Qwen-Image.

Why: vLLM-Omni 0.30 honours a ``--deploy-config`` YAML only when the model resolves to a
*registered* pipeline (``vllm_omni.config.pipeline_registry.OMNI_PIPELINES``). Wan2.1 diffusers
(``WanPipeline``) is registered; Qwen-Image is not, so it takes the generic single-stage fallback,
where the YAML content is ignored and ``--stage-overrides`` cannot set ``num_replicas`` or ``env``
(the fallback keeps only ``OmniDiffusionConfig`` fields). Replica data parallelism, the throughput
lever, is therefore unreachable for Qwen-Image without a registered topology.

:func:`register_preset_pipelines` registers one single-stage diffusion topology under its own key
(:data:`QWEN_IMAGE_PIPELINE_KEY`) with no ``diffusers_class_name``, so model auto-detection is
unchanged; only a deploy YAML that says ``pipeline: omni_ext_qwen_image`` selects it. It must run
in the ``vllm-omni serve`` head process before config resolution, i.e. from omni-ext's
``vllm.general_plugins`` hook.
"""

from __future__ import annotations

QWEN_IMAGE_PIPELINE_KEY = "omni_ext_qwen_image"


def build_qwen_image_pipeline():  # -> vllm_omni.config.stage_config.PipelineConfig
    """The Qwen-Image topology: one diffusion stage that outputs an image (same as the fallback)."""
    from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

    return PipelineConfig(
        model_type=QWEN_IMAGE_PIPELINE_KEY,
        model_arch="QwenImagePipeline",
        stages=(
            StagePipelineConfig(
                stage_id=0,
                model_stage="dit",
                execution_type=StageExecutionType.DIFFUSION,
                input_sources=(),
                final_output=True,
                final_output_type="image",
                model_arch="QwenImagePipeline",
            ),
        ),
    )


def is_registered() -> bool:
    """True when this process's vLLM-Omni pipeline registry knows :data:`QWEN_IMAGE_PIPELINE_KEY`."""
    try:
        from vllm_omni.config.pipeline_registry import OMNI_PIPELINES
    except ImportError:
        return False
    return QWEN_IMAGE_PIPELINE_KEY in OMNI_PIPELINES


def register_preset_pipelines() -> bool:
    """Register the preset topologies once per process; return False when vLLM-Omni is absent."""
    try:
        from vllm_omni.config.pipeline_registry import register_pipeline
    except ImportError:
        return False
    if not is_registered():
        register_pipeline(build_qwen_image_pipeline())
    return True
