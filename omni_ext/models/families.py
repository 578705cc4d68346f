"""The model-family table: what omni-ext knows per diffusion pipeline class that vLLM-Omni does not.

That is the native request shape, omni-ext's tuned class and the CFG rule it splits by, the cost
formula, the deploy-YAML topology and omni-ext's cancellation opt-in. Everything vLLM-Omni itself
knows of a class (video or image, request batching, step cancellation, reference inputs, sequence
parallel) is read from vLLM-Omni (:mod:`omni_ext.models.registry`) and decided on in
:mod:`omni_ext.models.decisions`; a class with no entry here gets vLLM-Omni's own behaviour. Every
other module (request validation and defaults, the tuned executor's CFG rule and cost, the tuned
pipeline registration, cancellation opt-in, preset rendering) reads this table instead of keeping
its own list of class names. Adding a model family is one entry here plus its tests; its names are
vLLM-Omni registry keys (``tests/test_registry_sweep.py`` fails on one that is not).

A pipeline class is the ``_class_name`` of a diffusers ``model_index.json`` (what vLLM-Omni
calls the model architecture, ``od_config.model_class_name``). This module imports nothing from
vLLM or vLLM-Omni: the scheduler and the tuned executor use it in pure code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["video", "image"]
CfgRule = Literal["wan", "qwen-image", "always"]


@dataclass(frozen=True)
class NativeShape:
    """What a request that names no size/length gets (the model's release defaults)."""

    width: int
    height: int
    num_frames: int = 1
    fps: int | None = None
    steps: int = 50


@dataclass(frozen=True)
class ModelFamily:
    """One family of pipelines that omni-ext treats alike.

    ``cfg_rule``: how a request's guidance decides whether it runs two branches (see
    :func:`needs_cfg`); ``"always"`` is vLLM-Omni's own assumption for a model omni-ext does not
    know (the request takes the whole CFG group).
    ``vllm_omni_class``: the vLLM-Omni class (``module:Class``) that implements the family's
    text-to-X pipeline, where cancellation is switched on and the tuned subclass derives from.
    ``tuned_class``: omni-ext's worker-side subclass (``module:Class``) registered under every
    name in ``pipelines`` inside TunedExecutor workers only; None: the stock class runs there.
    ``cancellable``: the denoise loop reaches a step boundary on every rank through the progress
    bar, so vLLM-Omni's cooperative cancellation can be switched on for it.
    ``topology``: how a deploy YAML reaches the family: ``"registered"`` (vLLM-Omni 0.30 has a
    pipeline topology under the class name), ``"omni-ext"`` (omni-ext registers one, see
    :mod:`omni_ext.presets.pipelines`) or None (only the generic single-stage fallback).
    ``latent_spatial`` x ``latent_spatial`` pixels make one transformer token (VAE downsampling x
    patch size); ``latent_temporal`` frames make one latent frame (video only); ``decode_units``
    is the VAE decode's cost in denoise-step equivalents. Together they are the cost formula
    (:meth:`cost_units`).
    ``partial_images``: the denoise loop is Qwen-Image's, whose packed latents the ``partial-images``
    patch decodes into previews for streamed requests (:mod:`omni_ext.partials`).
    """

    name: str
    kind: Kind
    pipelines: tuple[str, ...]
    native: NativeShape
    cfg_rule: CfgRule = "always"
    default_guidance: float = 4.0
    vllm_omni_class: str | None = None
    tuned_class: str | None = None
    cancellable: bool = False
    topology: Literal["registered", "omni-ext"] | None = None
    latent_spatial: int = 16
    latent_temporal: int = 4
    decode_units: float = 4.0
    partial_images: bool = False

    @property
    def is_video(self) -> bool:
        return self.kind == "video"

    @property
    def splits_cfg_groups(self) -> bool:
        """Whether the TunedExecutor may run this family's requests on one rank of a CFG group (a
        CFG-free request, or a CFG request with both branches on that rank): only a tuned pipeline
        keeps a one-rank job out of the group's collectives, and only a known CFG rule says which
        requests are CFG-free."""
        return self.tuned_class is not None and self.cfg_rule != "always"

    def shape_of(self, sp: Any) -> tuple[int, int, int, int]:
        """(width, height, frames, steps) of a request as the pipeline runs it: fields the request
        leaves unset take the family's native values; an image is one frame."""
        steps = _get(sp, "num_inference_steps") or self.native.steps
        h = _get(sp, "height") or self.native.height
        w = _get(sp, "width") or self.native.width
        frames = (_get(sp, "num_frames") or self.native.num_frames) if self.is_video else 1
        return int(w), int(h), int(frames), int(steps)

    def latent_tokens(self, width: float, height: float, frames: float = 1) -> float:
        """Transformer tokens of a ``width`` x ``height`` x ``frames`` output (one frame for an image)."""
        latent_frames = 1 + (max(1, int(frames)) - 1) / self.latent_temporal
        return (height / self.latent_spatial) * (width / self.latent_spatial) * latent_frames

    def cost_units(self, sp: Any, cfg: bool) -> float:
        """A request's expected work in arbitrary units: denoise steps x tokens x branches, plus decode."""
        w, h, frames, steps = self.shape_of(sp)
        return float(self.latent_tokens(w, h, frames) * (steps * (2 if cfg else 1) + self.decode_units))


@dataclass(frozen=True)
class SamplingFields:
    """The sampling fields this table's rules read (:meth:`ModelFamily.shape_of`, :func:`needs_cfg`,
    :func:`cost_units`), under the attribute names of vLLM-Omni's ``OmniDiffusionSamplingParams``:
    what the API process knows of a request before the engine builds those (the executor passes the
    engine's own). A guidance scale counts as provided when it is set, as vLLM-Omni's request
    models mark it."""

    num_inference_steps: int | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    true_cfg_scale: float | None = None

    @property
    def guidance_scale_provided(self) -> bool:
        return self.guidance_scale is not None

    @property
    def guidance_scale_2_provided(self) -> bool:
        return self.guidance_scale_2 is not None


_WAN_NATIVE = NativeShape(width=832, height=480, num_frames=81, fps=16, steps=50)

#: The table. Order matters only for readability.
FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily(
        name="wan2.x-t2v",
        kind="video",
        pipelines=("WanPipeline",),
        native=_WAN_NATIVE,
        cfg_rule="wan",
        default_guidance=4.0,
        vllm_omni_class="vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2:Wan22Pipeline",
        tuned_class="omni_ext.executor.pipelines:TunedWan22Pipeline",
        cancellable=True,
        topology="registered",
    ),
    ModelFamily(
        name="wan2.x-i2v",
        kind="video",
        pipelines=("WanImageToVideoPipeline",),
        native=_WAN_NATIVE,
        cfg_rule="wan",
        default_guidance=5.0,
        vllm_omni_class="vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2_i2v:Wan22I2VPipeline",
        tuned_class="omni_ext.executor.pipelines:TunedWan22I2VPipeline",
        cancellable=True,
    ),
    ModelFamily(
        name="qwen-image",
        kind="image",
        pipelines=("QwenImagePipeline",),
        native=NativeShape(width=1328, height=1328, steps=50),
        cfg_rule="qwen-image",
        default_guidance=4.0,
        vllm_omni_class="vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image:QwenImagePipeline",
        tuned_class="omni_ext.executor.pipelines:TunedQwenImagePipeline",
        cancellable=True,
        partial_images=True,
        topology="omni-ext",
    ),
    ModelFamily(
        # Qwen-Image-Edit and -Edit-Plus (2509, 2511) are two families only because each family has one
        # vLLM-Omni class and one tuned class: same rule, cost and cancellation.
        name="qwen-image-edit",
        kind="image",
        pipelines=("QwenImageEditPipeline",),
        native=NativeShape(width=1024, height=1024, steps=50),
        cfg_rule="qwen-image",
        default_guidance=4.0,
        vllm_omni_class="vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit:QwenImageEditPipeline",
        tuned_class="omni_ext.executor.pipelines:TunedQwenImageEditPipeline",
        cancellable=True,
        partial_images=True,
    ),
    ModelFamily(
        name="qwen-image-edit-plus",
        kind="image",
        pipelines=("QwenImageEditPlusPipeline",),
        native=NativeShape(width=1024, height=1024, steps=50),
        cfg_rule="qwen-image",
        default_guidance=4.0,
        vllm_omni_class=(
            "vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image_edit_plus:QwenImageEditPlusPipeline"
        ),
        tuned_class="omni_ext.executor.pipelines:TunedQwenImageEditPlusPipeline",
        cancellable=True,
        partial_images=True,
    ),
    ModelFamily(
        name="flux-kontext",
        kind="image",
        pipelines=("FluxKontextPipeline",),
        native=NativeShape(width=1024, height=1024, steps=28),
    ),
)

_BY_PIPELINE: dict[str, ModelFamily] = {p: f for f in FAMILIES for p in f.pipelines}
if len(_BY_PIPELINE) != sum(len(f.pipelines) for f in FAMILIES):  # pragma: no cover - a table typo
    raise RuntimeError("omni_ext.models.families: a pipeline class is listed in two families")


def family_of(pipeline: str | None) -> ModelFamily | None:
    """The family of a pipeline class, or None for a class omni-ext has no entry for."""
    return _BY_PIPELINE.get(pipeline or "")


def _get(obj: Any, name: str, default: Any = None) -> Any:
    return getattr(obj, name, default) if obj is not None else default


def wan_guidance(sp: Any, default: float = 4.0) -> tuple[float, float]:
    """(guidance_low, guidance_high) exactly as vLLM-Omni's Wan22Pipeline resolves them."""
    g = _get(sp, "guidance_scale") if _get(sp, "guidance_scale_provided", False) else default
    low = g if isinstance(g, (int, float)) else g[0]
    g2 = _get(sp, "guidance_scale_2")
    if _get(sp, "guidance_scale_2_provided", False) and g2 is not None:
        high = g2
    elif isinstance(g, (list, tuple)) and len(g) > 1:
        high = g[1]
    else:
        high = low
    return float(low), float(high)


def needs_cfg(pipeline: str | None, prompt: Any, sp: Any) -> bool:
    """Whether a request runs two guidance branches (and so can use a whole CFG group).

    Mirrors each pipeline's own test: Wan runs CFG when either guidance scale exceeds 1;
    Qwen-Image and Qwen-Image-Edit(-Plus) only when ``true_cfg_scale > 1`` *and* a negative prompt is given. Unknown models:
    True (vLLM-Omni's own behaviour: the request takes the whole CFG group).
    """
    family = family_of(pipeline)
    rule = family.cfg_rule if family is not None else "always"
    if rule == "wan":
        low, high = wan_guidance(sp, family.default_guidance if family else 4.0)
        return low > 1.0 or high > 1.0
    if rule == "qwen-image":
        scale = _get(sp, "true_cfg_scale") or (family.default_guidance if family else 4.0)
        has_neg = isinstance(prompt, dict) and (
            prompt.get("negative_prompt") is not None or prompt.get("negative_prompt_embeds") is not None
        )
        return scale > 1.0 and has_neg
    return True


def cost_units(pipeline: str | None, sp: Any, cfg: bool) -> float:
    """A request's expected work (see :meth:`ModelFamily.cost_units`); a model without a family costs
    by Wan's formula at the request's own length (one frame when it names none)."""
    family = family_of(pipeline)
    if family is not None:
        return family.cost_units(sp, cfg)
    w, h, _, steps = FAMILIES[0].shape_of(sp)
    frames = int(_get(sp, "num_frames") or 1)
    return float(FAMILIES[0].latent_tokens(w, h, frames) * (steps * (2 if cfg else 1) + FAMILIES[0].decode_units))


def tuned_pipelines() -> dict[str, str]:
    """Pipeline class name -> ``module:Class`` of omni-ext's tuned subclass (TunedExecutor workers)."""
    return {p: f.tuned_class for f in FAMILIES if f.tuned_class for p in f.pipelines}


def cancellable_classes() -> tuple[str, ...]:
    """vLLM-Omni classes (``module:Class``) to opt into cooperative cancellation."""
    return tuple(dict.fromkeys(f.vllm_omni_class for f in FAMILIES if f.cancellable and f.vllm_omni_class))


# ---- what a request costs, as every queue classes it ------------------------------------------
def shape_key(family: str | None, width: int | None, height: int | None, frames: int | None, cfg: bool) -> str:
    """The shape class a measured rate is kept for: family, size, length and CFG (steps scale the
    cost linearly and are already in the units, so they do not split classes)."""
    return f"{family or '?'}:{width or 0}x{height or 0}x{frames or 1}:{'cfg' if cfg else 'nocfg'}"


@dataclass(frozen=True)
class JobShape:
    """What a request costs as its pipeline runs it: its shape class (:func:`shape_key`), its work
    in cost units (:func:`cost_units`), whether it runs CFG and its denoise steps."""

    key: str
    units: float
    cfg: bool = False
    steps: int = 0
    #: Its steps where a class's fixed and per-step seconds predict it, else 0: a request of several
    #: outputs (``n``) counts them in its units, not in its class. A field, set by
    #: :func:`request_cost`, so that the API's admission reads it without a call.
    one_output_steps: int = 0


def request_cost(pipeline: str | None, prompt: Any, sp: Any, cfg: bool | None = None, n: int = 1) -> JobShape:
    """The :class:`JobShape` of a request (``prompt``, sampling params ``sp``: the engine's, or
    :class:`SamplingFields`): unset fields take the family's native values (a model without a
    family entry is sized like the first family, at the length the request names, else one frame);
    ``cfg`` decided by the caller, else by the pipeline's own rule (:func:`needs_cfg`); ``n``
    outputs cost ``n`` times one. The API's account, the head's dispatch and the TunedExecutor all
    class requests with this."""
    if cfg is None:
        cfg = needs_cfg(pipeline, prompt, sp)
    family = family_of(pipeline)
    width, height, frames, steps = (family or FAMILIES[0]).shape_of(sp)
    if family is None:  # no family: the request's own length (an image request names none)
        frames = int(_get(sp, "num_frames") or 1)
    key = shape_key(family.name if family else pipeline, width, height, frames, cfg)
    return JobShape(key, cost_units(pipeline, sp, cfg) * max(1, n), cfg, steps, steps if n <= 1 else 0)


def job_shape(
    pipeline: str | None, *, width: int | None, height: int | None, frames: int | None = None, steps: int | None = None,
    n: int = 1, negative_prompt: str | None = None, guidance_scale: float | None = None,
    guidance_scale_2: float | None = None, true_cfg_scale: float | None = None,
) -> JobShape:
    """:func:`request_cost` of an API request's fields, before the engine builds its sampling params."""
    sp = SamplingFields(num_inference_steps=steps, width=width, height=height, num_frames=frames,
                        guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, true_cfg_scale=true_cfg_scale)
    return request_cost(pipeline, {"negative_prompt": negative_prompt}, sp, n=n)
