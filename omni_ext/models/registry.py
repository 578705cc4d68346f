"""What vLLM-Omni itself knows about the pipelines it registers, and a served model's files, read from it.

vLLM-Omni's diffusion registry (``vllm_omni.diffusion.registry``) is the list of pipelines it serves;
its model metadata (``model_metadata.py``: output kind, reference inputs), its output-type rule
(``io_support.get_diffusion_output_type``) and each pipeline class's own declarations
(``supports_request_batch``, ``supports_request_cancellation``, ``support_image_input``, the
``CFGParallelMixin`` base, a transformer's ``_sp_plan``) say what each one is and does. omni-ext
reads these facts here, once per class, instead of keeping its own list of names: a class that a
later vLLM-Omni adds gets vLLM-Omni's own behaviour, never a guess from its name. What omni-ext
decides on them is pure code (:mod:`omni_ext.models.decisions`); the family table
(:mod:`omni_ext.models.families`) keeps only what vLLM-Omni does not know.

A served model's files are read the way vLLM-Omni reads them (:func:`model_root`,
:func:`model_json`): a local folder, a Hugging Face id (from the cache, offline, or the hub), or a
ModelScope id when ``VLLM_USE_MODELSCOPE`` is set. vLLM-Omni has fetched the whole snapshot before
its engine starts, so at omni-ext's start-up it is a folder on disk.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger("omni_ext.models")


@dataclass(frozen=True)
class PipelineFacts:
    """What vLLM-Omni says of one registry key (``model_index.json``'s ``_class_name``).

    ``loaded`` False: the class could not be imported on this host (``load_error`` says why); its
    capabilities then read False, and omni-ext's decisions fall back to vLLM-Omni's own path.
    ``step_cancellation``: the class opts into vLLM-Omni's cooperative cancellation itself;
    ``omni_ext_cancellation``: it derives from a class omni-ext opts in
    (:func:`omni_ext.models.families.cancellable_classes`, the ``cancel-at-step`` patch, unless the
    operator switched it off), so it cancels on a server with omni-ext installed.
    """

    key: str
    cls: str  # ``module:Class`` vLLM-Omni loads for the key
    output: str  # "video" | "image" | "audio": vLLM-Omni's get_diffusion_output_type
    #: The registry key vLLM-Omni's engine runs a model of this class as: a registered pipeline
    #: topology that lists the class among its diffusers aliases runs it under the topology's own key
    #: (FastWan's ``WanDMDPipeline`` runs as ``WanPipeline``, the DMD sampler chosen from the model's
    #: ``model_index.json``); else the key itself. omni-ext's family and tuned path follow this key.
    served_as: str = ""
    loaded: bool = True
    load_error: str = ""
    cfg_parallel: bool = False
    request_batch: bool = False
    step_cancellation: bool = False
    omni_ext_cancellation: bool = False
    step_execution: bool = False
    sequence_parallel: bool = False
    image_input: bool = False
    audio_input: bool = False
    max_image_inputs: int | None = None
    mixed_references: bool = False
    control_uploads: tuple[str, ...] = ()
    latent_mask_editing: bool = False
    cache_acceleration: bool = True
    aliases: tuple[str, ...] = field(default=(), compare=False)

    @property
    def cancellable(self) -> bool:
        """Whether a running request of this class stops at its next step on a server with omni-ext."""
        return self.step_cancellation or self.omni_ext_cancellation


def registry_keys() -> tuple[str, ...]:
    """Every pipeline class name the installed vLLM-Omni registers, in its own order."""
    from vllm_omni.diffusion.registry import _DIFFUSION_MODELS

    return tuple(_DIFFUSION_MODELS)


def is_registered(name: str | None) -> bool:
    from vllm_omni.diffusion.registry import _DIFFUSION_MODELS

    return bool(name) and name in _DIFFUSION_MODELS


def _sp_declared(cls: type) -> bool:
    """Whether a transformer of the pipeline's model package declares vLLM-Omni's ``_sp_plan``
    (what ``registry._apply_sequence_parallel_if_enabled`` reads to shard a transformer)."""
    package = cls.__module__.rsplit(".", 1)[0] + "."
    for name, module in list(sys.modules.items()):
        if not name.startswith(package) or module is None:
            continue
        for obj in vars(module).values():
            # declared in the class body, whatever the value: vLLM-Omni reads it with "is not None", an
            # empty plan switches its SP path on (Sana Video), and LTX-2 declares None and sets it per instance
            if isinstance(obj, type) and obj.__module__ == name and "_sp_plan" in vars(obj):
                return True
    return False


def served_as(key: str) -> str:
    """The key vLLM-Omni's engine loads for a model whose ``model_index.json`` names ``key``: the
    diffusion stage's ``model_arch`` of the registered pipeline topology that lists ``key`` as its
    diffusers class or alias (``config_factory`` detects the topology so, and ``omni_config`` makes that
    ``model_arch`` the stage's ``model_class_name``), else ``key``."""
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES

    for entry in OMNI_PIPELINES.values():
        if callable(entry):  # a resolver that needs the model's config: not a diffusers alias table
            continue
        if key not in (getattr(entry, "diffusers_class_name", None), *getattr(entry, "diffusers_class_aliases", ())):
            continue
        for stage in getattr(entry, "stages", ()):
            arch = getattr(stage, "model_arch", None)
            if str(getattr(getattr(stage, "execution_type", None), "value", "")).lower() == "diffusion" and arch:
                return arch
        return getattr(entry, "model_arch", None) or key
    return key


@functools.lru_cache(maxsize=None)
def facts_of(key: str) -> PipelineFacts | None:
    """The :class:`PipelineFacts` of a registry key, or None for a name vLLM-Omni does not register.
    Imports the pipeline's module (as vLLM-Omni does when it serves it): call it at start-up."""
    from vllm_omni.diffusion.model_metadata import get_diffusion_model_metadata
    from vllm_omni.diffusion.registry import _DIFFUSION_MODELS, _NO_CACHE_ACCELERATION, DiffusionModelRegistry

    entry = _DIFFUSION_MODELS.get(key)
    if entry is None:
        return None
    runs_as = served_as(key)
    if runs_as != key and runs_as in _DIFFUSION_MODELS:  # the engine runs it as another key: that key's facts
        other = facts_of(runs_as)
        if other is not None:
            return dataclasses.replace(other, key=key, served_as=runs_as, aliases=())
    folder, module, cls_name = entry
    qualname = f"vllm_omni.diffusion.models.{folder}.{module}:{cls_name}"
    meta = get_diffusion_model_metadata(key)
    common: dict[str, Any] = dict(
        key=key, cls=qualname, served_as=key, max_image_inputs=meta.max_multimodal_image_inputs,
        mixed_references=bool(meta.supports_mixed_reference_inputs),
        control_uploads=tuple(meta.supported_control_upload_types or ()),
        latent_mask_editing=bool(meta.supports_latent_mask_editing),
        cache_acceleration=key not in _NO_CACHE_ACCELERATION,
        aliases=tuple(k for k, v in _DIFFUSION_MODELS.items() if v == entry and k != key),
    )
    try:
        cls = DiffusionModelRegistry._try_load_model_cls(key)
        error = "" if cls is not None else _import_error(f"vllm_omni.diffusion.models.{folder}.{module}")
    except Exception as exc:  # pragma: no cover - _try_load_model_cls logs and returns None itself
        cls, error = None, f"{type(exc).__name__}: {exc}"
    if cls is None:
        return PipelineFacts(output=meta.final_output_type or "image", loaded=False, load_error=error,
                             image_input=bool(meta.supports_multimodal_inputs), **common)
    from vllm_omni.diffusion.distributed.cfg_parallel import CFGParallelMixin

    from omni_ext.models.families import cancellable_classes
    from omni_ext.patches import resolve, switched_off

    opted_in = not switched_off("cancel-at-step") and any(issubclass(cls, resolve(q)) for q in cancellable_classes())
    return PipelineFacts(
        output=output_type(key),
        cfg_parallel=issubclass(cls, CFGParallelMixin),
        request_batch=getattr(cls, "supports_request_batch", False) is True,
        step_cancellation=getattr(cls, "supports_request_cancellation", False) is True and not opted_in,
        omni_ext_cancellation=opted_in,
        step_execution=getattr(cls, "supports_step_execution", False) is True,
        sequence_parallel=_sp_declared(cls),
        image_input=bool(getattr(cls, "support_image_input", False) or meta.supports_multimodal_inputs),
        audio_input=bool(getattr(cls, "support_audio_input", False)),
        **common,
    )


def _import_error(module: str) -> str:
    """Why ``module`` does not import (vLLM-Omni's registry logs it and returns None)."""
    import importlib

    try:
        importlib.import_module(module)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {re.sub(r' [(]/[^)]*[)]', '', first)}"  # no host paths
    return "vLLM-Omni's registry could not load the class"


def output_type(pipeline: str | None) -> str:
    """What a pipeline class makes ("video", "image", "audio"), by vLLM-Omni's own rule for its stage
    configs (model metadata, then the class's audio flag, else "image"; an unregistered name: "image")."""
    from vllm_omni.diffusion.io_support import get_diffusion_output_type

    return get_diffusion_output_type(pipeline)


def all_facts() -> tuple[PipelineFacts, ...]:
    """:func:`facts_of` every registered class (imports all of them: ``omni-ext models``, the sweep test)."""
    return tuple(f for f in (facts_of(k) for k in registry_keys()) if f is not None)


# ---- the served model's files -----------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def model_root(model: str) -> Path | None:
    """The folder vLLM-Omni serves ``model`` from: a local folder as given, a ModelScope id's
    snapshot (``VLLM_USE_MODELSCOPE``), or a Hugging Face id's snapshot in the local cache (what
    vLLM-Omni downloaded before its engine started; with ``HF_HUB_OFFLINE=1`` what was there).
    None: not on disk (files are then read one by one from the hub, :func:`model_json`)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not model:
        return None
    try:
        from vllm import envs

        if envs.VLLM_USE_MODELSCOPE:
            from modelscope.hub.snapshot_download import snapshot_download as ms_snapshot

            return Path(ms_snapshot(model))
    except Exception:
        logger.warning("omni-ext: could not resolve ModelScope id %s", model, exc_info=True)
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        return None


def model_json(model: str, name: str) -> dict[str, Any]:
    """A JSON file of the served model (``model_index.json``, ``vae/config.json`` ...), read where
    vLLM-Omni reads it (:func:`model_root`, else the hub through vLLM's own reader); {} if absent."""
    root = model_root(model)
    if root is not None:
        try:
            data = json.loads((root / name).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
    if not model or Path(model).expanduser().exists():
        return {}
    try:
        from vllm.transformers_utils.config import get_hf_file_to_dict

        data = get_hf_file_to_dict(name, model, revision=None)
    except Exception:
        return {}
    return data if isinstance(data, dict) else {}


def model_index(model: str) -> dict[str, Any]:
    """The served model's diffusers index (``model_index.json``, else ``modular_model_index.json``, as
    vLLM-Omni's ``get_diffusion_model_index`` reads them)."""
    return model_json(model, "model_index.json") or model_json(model, "modular_model_index.json")
