"""What omni-ext does with each pipeline vLLM-Omni registers: pure decisions on vLLM-Omni's own facts.

Inputs: :class:`~omni_ext.models.registry.PipelineFacts` (what vLLM-Omni says of the class) and the
family-table entry (:mod:`omni_ext.models.families`: what only omni-ext knows, such as its tuned
class). Nothing here imports vLLM-Omni, so the rules are unit-tested on made-up facts and swept over
the real registry (``tests/test_registry_sweep.py``); ``omni-ext models`` prints them.

The rule that keeps a user whole: where omni-ext has no tuned path, vLLM-Omni's own behaviour
stands. The routes carry every input vLLM-Omni's routes take for the class (or hand the request to
vLLM-Omni's route), and the TunedExecutor runs a request the way vLLM-Omni's executor would, or
hands the whole model to vLLM-Omni's executor (:func:`executor_path`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from omni_ext.models.families import ModelFamily, family_of
from omni_ext.models.registry import PipelineFacts

Path = Literal["tuned", "passthrough", "unavailable"]
ExecutorPath = Literal["tuned", "whole-group", "stock"]

VIDEO_ROUTES = ("/v1/videos", "/v1/videos/sync")
IMAGE_ROUTES = ("/v1/images/generations",)
EDIT_ROUTES = ("/v1/images/edits",)


@dataclass(frozen=True)
class Decision:
    """omni-ext's answer for one registered pipeline class (one row of ``omni-ext models``).

    ``path``: ``tuned`` (omni-ext's tuned pipeline runs it under the TunedExecutor), ``passthrough``
    (vLLM-Omni's own pipeline and behaviour, behind omni-ext's routes and scheduler) or
    ``unavailable`` (vLLM-Omni cannot import the class on this host). ``routes``: the omni-ext routes
    that serve it (an audio model has none: vLLM-Omni's own routes serve it). ``inputs``: the
    reference inputs its requests carry (vLLM-Omni's metadata). ``cfg_rule``: how a request's
    guidance decides whether it runs two branches (``pipeline``: the pipeline's own forward decides;
    omni-ext gives the request its whole CFG group, as vLLM-Omni's executor does)."""

    key: str
    task: str
    path: Path
    reason: str
    routes: tuple[str, ...]
    inputs: tuple[str, ...]
    cfg_rule: str
    cfg_parallel: bool
    sequence_parallel: bool
    batching: bool
    cancellation: bool
    family: str | None = None
    tiny_model: str | None = None
    served_as: str = ""
    #: What the TunedExecutor does with it at data_parallel_size 2 (:func:`executor_path`): ``tuned``,
    #: ``whole-group`` (vLLM-Omni's pipeline, one request per group) or ``stock`` (vLLM-Omni's executor).
    executor_dp2: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def family_for(facts: PipelineFacts) -> ModelFamily | None:
    """The family-table entry of the key vLLM-Omni's engine runs the class as (``facts.served_as``)."""
    return family_of(facts.served_as or facts.key)


def inputs_of(facts: PipelineFacts) -> tuple[str, ...]:
    """The reference inputs the class declares to vLLM-Omni (its metadata and class flags). vLLM-Omni's
    video route accepts image, video and audio references for any class and lets the pipeline use them;
    these are the ones the class says it takes."""
    out = []
    if facts.image_input:
        out.append("image")
    if facts.latent_mask_editing:
        out.append("video")
    if facts.audio_input:
        out.append("audio")
    if facts.control_uploads:
        out.append("control")
    if facts.latent_mask_editing:
        out.append("mask")
    return tuple(out)


def routes_of(facts: PipelineFacts) -> tuple[str, ...]:
    """omni-ext's routes for the class, by vLLM-Omni's own output type."""
    if facts.output == "video":
        return VIDEO_ROUTES
    if facts.output == "image":
        return IMAGE_ROUTES + (EDIT_ROUTES if facts.image_input else ())
    return ()


def decide(facts: PipelineFacts, family: ModelFamily | None, tiny_model: str | None = None) -> Decision:
    """The :class:`Decision` for one class (``family``: the family-table entry of the key the engine
    runs it as, :func:`family_for`; or None)."""
    if not facts.loaded:
        path: Path = "unavailable"
        reason = f"vLLM-Omni cannot import it on this host ({facts.load_error})"
    elif family is not None and family.tuned_class:
        path, reason = "tuned", f"omni-ext's {family.tuned_class.rpartition(':')[2]} (family {family.name})"
        if facts.served_as and facts.served_as != facts.key:
            reason += f"; vLLM-Omni runs it as {facts.served_as}"
    elif facts.output == "audio":
        path, reason = "passthrough", "audio: vLLM-Omni's own routes and executor serve it unchanged"
    else:
        path, reason = "passthrough", "vLLM-Omni's own pipeline; omni-ext adds its routes, queue and scheduler"
    tuned = path == "tuned"
    return Decision(
        key=facts.key, task=facts.output, path=path, reason=reason, routes=routes_of(facts), inputs=inputs_of(facts),
        cfg_rule=family.cfg_rule if tuned and family is not None else "pipeline",
        cfg_parallel=facts.cfg_parallel, sequence_parallel=facts.sequence_parallel, batching=facts.request_batch,
        cancellation=facts.cancellable, family=family.name if family is not None else None, tiny_model=tiny_model,
        served_as=facts.served_as or facts.key, executor_dp2=executor_path(facts, family, dp=2)[0],
    )


def executor_path(facts: PipelineFacts | None, family: ModelFamily | None, *, dp: int, max_num_seqs: int = 1) -> tuple[ExecutorPath, str]:
    """How ``--distributed-executor-backend omni_ext.executor.TunedExecutor`` runs a model, and why.

    - ``tuned``: omni-ext's tuned pipeline (CFG split, single-rank jobs, preemption, data parallel).
    - ``whole-group``: vLLM-Omni's pipeline, each request on one whole data-parallel group, so
      several groups run different requests at once. Only where that loses nothing vLLM-Omni's own
      executor gives: no step cancellation (its per-step all-reduce spans every rank, and the ranks
      of another group never join it), and no request batching at ``--max-num-seqs`` > 1.
    - ``stock``: vLLM-Omni's own executor runs the model, unchanged: the same bytes, batching,
      cancellation and CFG rule as without omni-ext.
    """
    if facts is not None and not facts.loaded:
        return "stock", "vLLM-Omni's registry has no importable class for it"
    if family is not None and family.tuned_class:
        return "tuned", f"omni-ext's tuned pipeline for family {family.name}"
    if facts is None:
        return "stock", "vLLM-Omni's registry has no class of that name"
    if dp < 2:
        return "stock", ("no tuned pipeline and one data-parallel group: vLLM-Omni's own executor runs it "
                         "exactly as without omni-ext")
    if facts.cancellable:
        return "stock", ("it opts into vLLM-Omni's step cancellation, whose per-step all-reduce spans every rank: "
                         "with data-parallel groups running different requests it would hang")
    if max_num_seqs > 1 and facts.request_batch:
        return "stock", f"vLLM-Omni batches its requests (--max-num-seqs {max_num_seqs}); the TunedExecutor would not"
    return "whole-group", "vLLM-Omni's pipeline, one request per data-parallel group"
