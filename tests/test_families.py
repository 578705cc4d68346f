"""The model-family table (pure: no vLLM import) and the rules read from it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from omni_ext.models import families
from omni_ext.models.families import FAMILIES, family_of, needs_cfg


def sp(**kw):
    return SimpleNamespace(**kw)


def test_every_pipeline_class_belongs_to_one_family() -> None:
    names = [p for f in FAMILIES for p in f.pipelines]
    assert len(names) == len(set(names))
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
    for f in FAMILIES:
        assert f.kind in ("video", "image")
        assert f.native.width % f.latent_spatial == 0 and f.native.height % f.latent_spatial == 0
        if f.tuned_class or f.cancellable:
            assert f.vllm_omni_class, f"{f.name}: a tuned or cancellable family names its vLLM-Omni class"


@pytest.mark.parametrize(
    "pipeline,video",
    [("WanPipeline", True), ("WanImageToVideoPipeline", True), ("WanDMDPipeline", True), ("WanVACEPipeline", True),
     ("LTX2Pipeline", True), ("MiniMaxH3Pipeline", True), ("HeliosPipeline", True), ("QwenImagePipeline", False),
     ("QwenImageEditPipeline", False), ("StableDiffusion3Pipeline", False), ("SomeNewVideoPipeline", False),
     (None, False)],
)
def test_video_or_image_is_vllm_omnis_own_answer_not_the_class_name(pipeline, video) -> None:
    """VACE, LTX-2, MiniMax-H3, Helios and FastWan's WanDMDPipeline make video by vLLM-Omni's metadata
    although their names hold no "Video"; an unknown name makes what vLLM-Omni says it makes (image)."""
    from omni_ext.models.registry import output_type

    assert (output_type(pipeline) == "video") is video


def test_wan_cfg_rule_follows_both_guidance_scales() -> None:
    assert needs_cfg("WanPipeline", {}, sp()) is True  # default guidance 4.0
    assert needs_cfg("WanPipeline", {}, sp(guidance_scale=1.0, guidance_scale_provided=True)) is False
    assert needs_cfg(
        "WanPipeline", {},
        sp(guidance_scale=1.0, guidance_scale_provided=True, guidance_scale_2=3.0, guidance_scale_2_provided=True),
    ) is True
    assert families.wan_guidance(sp(guidance_scale=[2.0, 5.0], guidance_scale_provided=True)) == (2.0, 5.0)


def test_qwen_image_runs_cfg_only_with_a_negative_prompt() -> None:
    assert needs_cfg("QwenImagePipeline", {"prompt": "x"}, sp()) is False
    assert needs_cfg("QwenImagePipeline", {"prompt": "x", "negative_prompt": "y"}, sp()) is True
    assert needs_cfg("QwenImagePipeline", {"prompt": "x", "negative_prompt": "y"}, sp(true_cfg_scale=1.0)) is False


@pytest.mark.parametrize("pipeline", ["QwenImageEditPipeline", "QwenImageEditPlusPipeline"])
def test_qwen_image_edit_runs_cfg_by_the_qwen_image_rule(pipeline) -> None:
    """vLLM-Omni's edit forwards: do_true_cfg = (true_cfg_scale or 4.0) > 1 and negative_prompt is not None."""
    assert needs_cfg(pipeline, {"prompt": "x"}, sp()) is False
    assert needs_cfg(pipeline, {"prompt": "x", "negative_prompt": " "}, sp()) is True
    assert needs_cfg(pipeline, {"prompt": "x", "negative_prompt": "y"}, sp(true_cfg_scale=1.0)) is False
    assert family_of(pipeline).splits_cfg_groups  # type: ignore[union-attr]


def test_unknown_model_takes_the_whole_cfg_group() -> None:
    assert needs_cfg("SomeNewPipeline", {}, sp(guidance_scale=1.0, guidance_scale_provided=True)) is True


def test_cost_grows_with_steps_tokens_frames_and_branches() -> None:
    base = families.cost_units("WanPipeline", sp(width=64, height=64, num_frames=9, num_inference_steps=4), False)
    assert families.cost_units("WanPipeline", sp(width=64, height=64, num_frames=9, num_inference_steps=4), True) > base
    assert families.cost_units("WanPipeline", sp(width=128, height=64, num_frames=9, num_inference_steps=4), False) == 2 * base
    longer = families.cost_units("WanPipeline", sp(width=64, height=64, num_frames=81, num_inference_steps=4), False)
    assert longer == pytest.approx(base * 21 / 3)  # latent frames 1 + 80/4 = 21 vs 1 + 8/4 = 3
    # An image model ignores num_frames; unset fields take the family's native request.
    qwen = families.cost_units("QwenImagePipeline", sp(width=64, height=64, num_frames=81, num_inference_steps=4), False)
    assert qwen == families.cost_units("QwenImagePipeline", sp(width=64, height=64, num_inference_steps=4), False)
    native = family_of("WanPipeline").native  # type: ignore[union-attr]
    assert families.cost_units("WanPipeline", sp(), True) == families.cost_units(
        "WanPipeline",
        sp(width=native.width, height=native.height, num_frames=native.num_frames, num_inference_steps=native.steps),
        True,
    )


def test_tuned_and_cancellable_classes_come_from_the_table() -> None:
    tuned = families.tuned_pipelines()
    assert tuned["WanPipeline"].endswith(":TunedWan22Pipeline")
    assert tuned["QwenImagePipeline"].endswith(":TunedQwenImagePipeline")
    assert tuned["QwenImageEditPipeline"].endswith(":TunedQwenImageEditPipeline")
    assert tuned["QwenImageEditPlusPipeline"].endswith(":TunedQwenImageEditPlusPipeline")
    assert tuned["WanImageToVideoPipeline"].endswith(":TunedWan22I2VPipeline")
    assert set(families.cancellable_classes()) >= {
        "vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2:Wan22Pipeline",
        "vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2_i2v:Wan22I2VPipeline",
        "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image:QwenImagePipeline",
        "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit:QwenImageEditPipeline",
        "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus:QwenImageEditPlusPipeline",
    }


def test_the_table_names_real_vllm_omni_and_omni_ext_classes() -> None:
    """A vLLM-Omni release that moves a class the table names fails here, not at a request."""
    import importlib

    for f in FAMILIES:
        for qualname in filter(None, (f.vllm_omni_class, f.tuned_class)):
            module, _, cls = qualname.partition(":")
            assert hasattr(importlib.import_module(module), cls), qualname


def test_tiny_models_resolve_to_their_family(tmp_path) -> None:
    from omni_ext.models.tiny import MODELS, PIPELINES, build_tiny_model

    for model in MODELS:  # each tiny model is built as the class PIPELINES names, which has a tuned family
        index = json.loads((build_tiny_model(model, tmp_path / model) / "model_index.json").read_text())
        assert index["_class_name"] == PIPELINES[model]
        assert family_of(index["_class_name"]).tuned_class, model  # type: ignore[union-attr]


def test_tuned_classes_answer_name_lookups_as_their_vllm_omni_class() -> None:
    """Cache backends choose a model's set-up by ``type(pipeline).__name__`` (cache-dit: Wan22Pipeline ->
    its Wan2.2 enabler); a tuned pipeline gets the set-up of the class it derives from."""
    from vllm_omni.diffusion.cache.cachedit.model_specific import CUSTOM_DIT_ENABLERS, register_custom_dit_enablers

    from omni_ext.executor.pipelines import TunedQwenImagePipeline, TunedWan22Pipeline

    register_custom_dit_enablers()
    assert TunedWan22Pipeline.__name__ == "Wan22Pipeline" and TunedWan22Pipeline.__qualname__ == "TunedWan22Pipeline"
    assert CUSTOM_DIT_ENABLERS[TunedWan22Pipeline.__name__].__name__ == "enable_cache_for_wan22"
    assert TunedQwenImagePipeline.__name__ == "QwenImagePipeline"
    from omni_ext.executor.pipelines import TunedQwenImageEditPipeline, TunedQwenImageEditPlusPipeline

    assert TunedQwenImageEditPipeline.__name__ == "QwenImageEditPipeline"
    assert TunedQwenImageEditPlusPipeline.__name__ == "QwenImageEditPlusPipeline"
    assert TunedQwenImageEditPlusPipeline.__qualname__ == "TunedQwenImageEditPlusPipeline"
