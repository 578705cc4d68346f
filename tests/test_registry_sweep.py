"""omni-ext's decisions, swept over every pipeline class the installed vLLM-Omni registers.

The family table names vLLM-Omni registry keys and agrees with vLLM-Omni on what each is; every
registered class gets a decision that agrees with vLLM-Omni's own facts (routes by its output type,
its batching, cancellation and CFG parallel), and where omni-ext has no tuned path, vLLM-Omni's own
executor runs it. The rules themselves are unit-tested on made-up facts, including a class a later
vLLM-Omni adds. The page ``docs/reference/models.md`` is checked with the other generated pages
(``tests/test_reference_docs.py``). Pure: no server; the facts are read once
(:func:`omni_ext.models.registry.all_facts` imports every registered pipeline module, ~12 s).
"""

from __future__ import annotations

import json

import pytest

from omni_ext.models import matrix
from omni_ext.models.decisions import Decision, decide, executor_path, family_for, inputs_of, routes_of
from omni_ext.models.families import FAMILIES, ModelFamily, NativeShape, family_of
from omni_ext.models.registry import PipelineFacts, all_facts, registry_keys
from omni_ext.models.tiny import MODELS, PIPELINES, RELABELLED
from omni_ext.patches import omni_version

#: vLLM-Omni's registry keys, read once at collection (the ids of the per-class sweep).
KEYS = registry_keys()


@pytest.fixture(scope="module")
def facts() -> dict[str, PipelineFacts]:
    """vLLM-Omni's facts of every registered class, by key (computed once for the module)."""
    return {f.key: f for f in all_facts()}


# ---- the family table names what vLLM-Omni registers -------------------------------------------
def test_family_pipelines_are_registry_keys() -> None:
    keys = set(registry_keys())
    bad = [f"{family.name}: {name}" for family in FAMILIES for name in family.pipelines if name not in keys]
    assert not bad, f"family-table pipeline names that vLLM-Omni {omni_version()} does not register: {bad}"


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family_agrees_with_vllm_omni(family: ModelFamily, facts: dict[str, PipelineFacts]) -> None:
    for name in family.pipelines:
        f = facts[name]
        assert f.loaded, f"{name}: vLLM-Omni cannot import it here ({f.load_error})"
        assert family.kind == f.output, (
            f"family {family.name} says {family.kind}; vLLM-Omni's {name} outputs {f.output}")
        if family.vllm_omni_class:
            assert family.vllm_omni_class == f.cls, (
                f"family {family.name} names {family.vllm_omni_class}; vLLM-Omni loads {f.cls} for {name}")


def test_every_key_has_facts(facts: dict[str, PipelineFacts]) -> None:
    assert list(facts) == list(KEYS)
    assert all(f.output in ("video", "image", "audio") for f in facts.values())


# ---- every registered class: omni-ext's decision agrees with vLLM-Omni ---------------------------
@pytest.mark.parametrize("key", KEYS, ids=KEYS)
def test_decision_agrees_with_vllm_omni(key: str, facts: dict[str, PipelineFacts]) -> None:
    f = facts[key]
    family = family_for(f)  # the family of the key vLLM-Omni's engine runs the class as
    d = decide(f, family)
    assert d.key == key and d.task == f.output
    if f.output == "video":
        assert d.routes and all(r.startswith("/v1/videos") for r in d.routes) and "/v1/videos" in d.routes
    elif f.output == "image":
        assert d.routes == ("/v1/images/generations",) + (("/v1/images/edits",) if f.image_input else ())
    else:
        assert f.output == "audio" and d.routes == ()
    assert d.batching == f.request_batch
    assert d.cancellation == f.cancellable
    assert d.cfg_parallel == f.cfg_parallel
    assert d.sequence_parallel == f.sequence_parallel
    tuned = bool(family is not None and family.tuned_class)
    assert (d.path == "tuned") == tuned, d
    assert (d.path == "unavailable") == (not f.loaded), d
    assert d.cfg_rule == (family.cfg_rule if tuned else "pipeline")  # type: ignore[union-attr]
    assert d.family == (family.name if family else None)
    assert d.executor_dp2 == executor_path(f, family, dp=2)[0]

    if tuned:
        assert {executor_path(f, family, dp=dp)[0] for dp in (1, 2, 4)} == {"tuned"}
        return
    assert executor_path(f, family, dp=1)[0] == "stock"
    assert executor_path(f, family, dp=1, max_num_seqs=4)[0] == "stock"
    if f.cancellable or f.request_batch:
        assert executor_path(f, family, dp=2, max_num_seqs=2)[0] == "stock"
    for dp in (1, 2, 4, 8):
        for seqs in (1, 2, 4):
            path, why = executor_path(f, family, dp=dp, max_num_seqs=seqs)
            assert why
            if f.cancellable:
                assert path != "whole-group", (dp, seqs, why)


# ---- the rules, on made-up facts --------------------------------------------------------------
def _family(**kw) -> ModelFamily:
    base = dict(name="made-up", kind="video", pipelines=("MadeUpPipeline",), native=NativeShape(width=64, height=64))
    return ModelFamily(**{**base, **kw})


TUNED = _family(cfg_rule="wan", tuned_class="omni_ext.made_up:TunedMadeUp", vllm_omni_class="vllm_omni.x:MadeUp")


@pytest.mark.parametrize(
    "facts,routes",
    [(PipelineFacts(key="FutureVideoPipeline", cls="vllm_omni.diffusion.models.future.p:FutureVideoPipeline",
                    output="video", cfg_parallel=True, request_batch=True, step_cancellation=True),
      ("/v1/videos", "/v1/videos/sync")),
     (PipelineFacts(key="FutureImagePipeline", cls="m:C", output="image"), ("/v1/images/generations",)),
     (PipelineFacts(key="FutureEditPipeline", cls="m:C", output="image", image_input=True),
      ("/v1/images/generations", "/v1/images/edits")),
     (PipelineFacts(key="FutureAudioPipeline", cls="m:C", output="audio", audio_input=True), ())],
    ids=["video", "image", "edit", "audio"],
)
def test_a_class_a_later_vllm_omni_adds_runs_as_vllm_omni_runs_it(facts: PipelineFacts, routes: tuple) -> None:
    assert facts.key not in KEYS and family_of(facts.key) is None
    d = decide(facts, family_of(facts.key))
    assert d.path == "passthrough" and d.family is None and d.tiny_model is None and d.cfg_rule == "pipeline"
    assert d.routes == routes
    assert (d.batching, d.cancellation, d.cfg_parallel) == (facts.request_batch, facts.cancellable, facts.cfg_parallel)
    assert executor_path(facts, None, dp=1) == executor_path(facts, None, dp=1, max_num_seqs=8)
    assert executor_path(facts, None, dp=1)[0] == "stock"
    assert matrix.decisions([facts]) == [d]


def test_unavailable_class() -> None:
    f = PipelineFacts(key="BrokenPipeline", cls="m:Broken", output="image", loaded=False, load_error="ImportError: x")
    d = decide(f, None)
    assert d.path == "unavailable" and "ImportError: x" in d.reason
    assert executor_path(f, None, dp=2) == ("stock", "vLLM-Omni's registry has no importable class for it")
    assert executor_path(None, None, dp=4)[0] == "stock"  # a name vLLM-Omni does not register


def test_tuned_family() -> None:
    f = PipelineFacts(key="MadeUpPipeline", cls="vllm_omni.x:MadeUp", output="video", cfg_parallel=True,
                      step_cancellation=True)
    d = decide(f, TUNED, tiny_model="made-up-tiny")
    assert (d.path, d.cfg_rule, d.family, d.tiny_model) == ("tuned", "wan", "made-up", "made-up-tiny")
    assert "TunedMadeUp" in d.reason
    assert all(executor_path(f, TUNED, dp=dp, max_num_seqs=s)[0] == "tuned" for dp in (1, 2) for s in (1, 2))
    untuned = decide(f, _family())  # a family entry without a tuned class: vLLM-Omni's pipeline
    assert (untuned.path, untuned.cfg_rule, untuned.family) == ("passthrough", "pipeline", "made-up")
    assert executor_path(f, _family(), dp=1)[0] == "stock"


@pytest.mark.parametrize(
    "kw,dp,seqs,path",
    [({}, 1, 1, "stock"), ({}, 2, 1, "whole-group"), ({}, 2, 4, "whole-group"),
     ({"step_cancellation": True}, 2, 1, "stock"), ({"omni_ext_cancellation": True}, 4, 1, "stock"),
     ({"request_batch": True}, 2, 1, "whole-group"), ({"request_batch": True}, 2, 2, "stock"),
     ({"request_batch": True}, 1, 2, "stock")],
)
def test_executor_path_untuned(kw: dict, dp: int, seqs: int, path: str) -> None:
    f = PipelineFacts(key="MadeUpPipeline", cls="m:C", output="video", **kw)
    assert executor_path(f, None, dp=dp, max_num_seqs=seqs)[0] == path


@pytest.mark.parametrize(
    "kw,inputs",
    [({}, ()), ({"image_input": True}, ("image",)), ({"audio_input": True}, ("audio",)),
     ({"control_uploads": ("edge",)}, ("control",)), ({"latent_mask_editing": True}, ("video", "mask")),
     ({"image_input": True, "latent_mask_editing": True, "audio_input": True}, ("image", "video", "audio", "mask"))],
)
def test_inputs(kw: dict, inputs: tuple) -> None:
    f = PipelineFacts(key="MadeUpPipeline", cls="m:C", output="video", **kw)
    assert inputs_of(f) == inputs
    assert decide(f, None).inputs == inputs


def test_routes_by_output() -> None:
    video = PipelineFacts(key="A", cls="m:C", output="video", image_input=True)
    assert routes_of(video) == ("/v1/videos", "/v1/videos/sync")
    assert routes_of(PipelineFacts(key="A", cls="m:C", output="audio", image_input=True)) == ()


def test_cancellable_is_either_opt_in() -> None:
    assert not PipelineFacts(key="A", cls="m:C", output="image").cancellable
    assert PipelineFacts(key="A", cls="m:C", output="image", step_cancellation=True).cancellable
    assert PipelineFacts(key="A", cls="m:C", output="image", omni_ext_cancellation=True).cancellable


def test_decision_as_dict_is_json() -> None:
    d = decide(PipelineFacts(key="A", cls="m:C", output="image", image_input=True), None)
    out = json.loads(json.dumps(d.as_dict()))
    assert out["routes"] == ["/v1/images/generations", "/v1/images/edits"] and out["path"] == "passthrough"
    assert set(out) == set(Decision.__dataclass_fields__)


# ---- the matrix: omni-ext models ---------------------------------------------------------------
def test_matrix(facts: dict[str, PipelineFacts]) -> None:
    rows = matrix.decisions(facts.values())
    assert [d.key for d in rows] == list(KEYS)
    counts = matrix.counts(rows)
    assert sum(counts.values()) == len(KEYS)
    # tuned: the tuned families' keys, and every class vLLM-Omni runs as one of them (WanDMDPipeline)
    assert counts["tuned"] == sum(1 for f in facts.values() if f.loaded and (fam := family_for(f)) and fam.tuned_class)
    assert counts["tuned"] >= sum(len(f.pipelines) for f in FAMILIES if f.tuned_class)
    assert counts["unavailable"] == sum(not f.loaded for f in facts.values())
    for model in MODELS:  # every tiny model is a registered class the matrix says it is tested on
        assert PIPELINES[model] in facts, model
        assert model in next(d for d in rows if d.key == PIPELINES[model]).tiny_model.split(", ")
    named = {m for d in rows if d.tiny_model for m in d.tiny_model.split(", ")}
    assert named == set(MODELS) | {f"{m} (relabelled)" for m in RELABELLED.values()}
    text = matrix.text_table(rows)
    assert all(k in text for k in KEYS) and matrix.counts_line(rows) in text
    table = matrix.markdown_table(rows)
    assert len(table.splitlines()) == 2 + len(KEYS)
    assert all(line.count(" | ") == len(matrix.COLUMNS) for line in table.splitlines()[2:])  # one cell per column, then the reason


def test_cli_markdown_is_the_page(facts: dict[str, PipelineFacts], capsys: pytest.CaptureFixture[str]) -> None:
    from omni_ext.cli import main

    assert main(["models", "--markdown"]) == 0
    assert capsys.readouterr().out == matrix.markdown_page(matrix.decisions(facts.values()), omni_version())
    assert main(["models", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["vllm_omni"] == omni_version()
    assert [m["key"] for m in out["models"]] == list(KEYS)
    assert out["counts"] == matrix.counts(matrix.decisions(facts.values()))
