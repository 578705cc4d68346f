"""Registered pipeline topologies that let a deploy YAML configure the families vLLM-Omni does not register.

Why: vLLM-Omni 0.30 honours a ``--deploy-config`` YAML only when the model resolves to a
*registered* pipeline (``vllm_omni.config.pipeline_registry.OMNI_PIPELINES``). Wan2.1 diffusers
(``WanPipeline``) is registered; Qwen-Image is not, so it takes the generic single-stage fallback,
where the YAML content is ignored and ``--stage-overrides`` cannot set ``num_replicas`` or ``env``
(the fallback keeps only ``OmniDiffusionConfig`` fields). Replica data parallelism, the throughput
lever, is therefore unreachable for Qwen-Image without a registered topology.

Which families get one is the family table's ``topology == "omni-ext"``
(:mod:`omni_ext.models.families`). :func:`register_preset_pipelines` registers one single-stage
diffusion topology per such family under its own key (:func:`pipeline_key`, e.g.
:data:`QWEN_IMAGE_PIPELINE_KEY`) with no ``diffusers_class_name``, so model auto-detection is
unchanged; only a deploy YAML that says ``pipeline: omni_ext_qwen_image`` selects it. It must run
in the ``vllm-omni serve`` head process before config resolution, i.e. from omni-ext's
``vllm.general_plugins`` hook.
"""

from __future__ import annotations

from typing import Any

from omni_ext.models.families import FAMILIES, ModelFamily


def pipeline_key(family: ModelFamily) -> str:
    """The registry key omni-ext registers ``family``'s topology under (``qwen-image`` -> ``omni_ext_qwen_image``)."""
    return "omni_ext_" + family.name.replace("-", "_").replace(".", "_")


#: Families whose deploy YAML needs omni-ext's topology. Each topology serves the family's first
#: pipeline class (the stage's ``model_arch`` is that class).
OMNI_EXT_FAMILIES: tuple[ModelFamily, ...] = tuple(f for f in FAMILIES if f.topology == "omni-ext")

#: Pipeline class -> the key of omni-ext's registered topology for it.
OMNI_EXT_PIPELINES: dict[str, str] = {f.pipelines[0]: pipeline_key(f) for f in OMNI_EXT_FAMILIES}

QWEN_IMAGE_PIPELINE_KEY = OMNI_EXT_PIPELINES["QwenImagePipeline"]


def build_pipeline(family: ModelFamily) -> Any:  # -> vllm_omni.config.stage_config.PipelineConfig
    """``family``'s topology: one diffusion stage that outputs its kind (what the generic fallback builds)."""
    from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

    arch = family.pipelines[0]
    return PipelineConfig(
        model_type=pipeline_key(family),
        model_arch=arch,
        stages=(
            StagePipelineConfig(
                stage_id=0,
                model_stage="dit",
                execution_type=StageExecutionType.DIFFUSION,
                input_sources=(),
                final_output=True,
                final_output_type=family.kind,
                model_arch=arch,
            ),
        ),
    )


def is_registered() -> bool:
    """True when this process's vLLM-Omni pipeline registry knows every key of :data:`OMNI_EXT_PIPELINES`."""
    try:
        from vllm_omni.config.pipeline_registry import OMNI_PIPELINES
    except ImportError:
        return False
    return all(key in OMNI_PIPELINES for key in OMNI_EXT_PIPELINES.values())


def register_preset_pipelines() -> bool:
    """Register the preset topologies once per process; return False when vLLM-Omni is absent."""
    try:
        from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
    except ImportError:
        return False
    for family in OMNI_EXT_FAMILIES:
        if pipeline_key(family) not in OMNI_PIPELINES:
            register_pipeline(build_pipeline(family))
    return True
