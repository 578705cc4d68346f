"""Tests for omni_ext.models.tiny: deterministic, loadable, runnable tiny pipelines.

Each model is built twice per module (once more for the float32 and overwrite checks), so the whole
file stays well under a minute on a shared 2-core CPU box.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import diffusers  # noqa: E402

from omni_ext.models.tiny import (  # noqa: E402
    INFO_FILE,
    ONLY_FOR,
    MODELS,
    PIPELINES,
    QWEN_IMAGE_EDIT_TEMPLATE_PREFIX,
    QWEN_IMAGE_EDIT_TEMPLATE_TOKENS,
    QWEN_IMAGE_PROMPT_TEMPLATE,
    QWEN_IMAGE_TEMPLATE_TOKENS,
    SIZES,
    build_tiny_model,
    model_info,
)

_SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float32": "F32"}


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _safetensors_dtypes(path: Path) -> set[str]:
    """Tensor dtypes from a safetensors header (8-byte little-endian length + JSON), without torch."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each model built twice (default size/dtype) into separate dirs."""
    root = tmp_path_factory.mktemp("tiny")
    return {m: (build_tiny_model(m, root / f"{m}-a"), build_tiny_model(m, root / f"{m}-b")) for m in MODELS}


def test_api_constants() -> None:
    assert MODELS == ("wan2.1-t2v", "wan2.2-i2v", "wan2.2-ti2v", "qwen-image", "qwen-image-edit", "qwen-image-edit-plus")
    assert PIPELINES == {"wan2.1-t2v": "WanPipeline", "wan2.2-i2v": "WanImageToVideoPipeline",
                         "wan2.2-ti2v": "WanPipeline", "qwen-image": "QwenImagePipeline",
                         "qwen-image-edit": "QwenImageEditPipeline", "qwen-image-edit-plus": "QwenImageEditPlusPipeline"}
    assert SIZES == ("tiny", "small", "med", "1.3b") and ONLY_FOR == {"1.3b": ("wan2.1-t2v",)}


@pytest.mark.parametrize("model", MODELS)
def test_rebuild_is_byte_identical(built: dict[str, tuple[Path, Path]], model: str) -> None:
    a, b = built[model]
    assert a.is_absolute() and b.is_absolute()
    ta, tb = _tree_bytes(a), _tree_bytes(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name] == tb[name], f"{model}: {name} differs between builds"
    # Nothing written may mention where it was built (temp dir, out dir, pytest's tmp root).
    for name, data in ta.items():
        assert str(a.parent).encode() not in data, f"{name} leaks a build path"
    # No leftover temp dirs next to the output.
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        (
            "wan2.1-t2v",
            {
                "_class_name": "WanPipeline",
                "transformer": ["diffusers", "WanTransformer3DModel"],
                "vae": ["diffusers", "AutoencoderKLWan"],
                "text_encoder": ["transformers", "UMT5EncoderModel"],
                "tokenizer": ["transformers", "T5TokenizerFast"],
                "scheduler": ["diffusers", "UniPCMultistepScheduler"],
            },
        ),
        (
            "qwen-image",
            {
                "_class_name": "QwenImagePipeline",
                "transformer": ["diffusers", "QwenImageTransformer2DModel"],
                "vae": ["diffusers", "AutoencoderKLQwenImage"],
                "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
                "tokenizer": ["transformers", "Qwen2Tokenizer"],
                "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            },
        ),
        *(
            (
                model,
                {
                    "_class_name": cls,
                    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
                    "vae": ["diffusers", "AutoencoderKLQwenImage"],
                    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
                    "tokenizer": ["transformers", "Qwen2Tokenizer"],
                    "processor": ["transformers", "Qwen2VLProcessor"],
                    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
                },
            )
            for model, cls in (("qwen-image-edit", "QwenImageEditPipeline"),
                               ("qwen-image-edit-plus", "QwenImageEditPlusPipeline"))
        ),
    ],
)
def test_layout_and_class_names(built: dict[str, tuple[Path, Path]], model: str, layout: dict) -> None:
    path = built[model][0]
    index = json.loads((path / "model_index.json").read_text())
    for key, value in layout.items():
        assert index[key] == value
    for sub in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler") + (("processor",) if "processor" in layout else ()):
        assert (path / sub).is_dir()
    assert (path / "tokenizer" / "tokenizer.json").is_file()
    assert model_info(path) == {"pipeline": layout["_class_name"], "model": model, "size": "tiny", "dtype": "bfloat16"}
    assert PIPELINES[model] == layout["_class_name"]  # what omni-ext models says each class is tested on


def test_scheduler_configs_match_releases(built: dict[str, tuple[Path, Path]]) -> None:
    wan = json.loads((built["wan2.1-t2v"][0] / "scheduler" / "scheduler_config.json").read_text())
    assert wan["prediction_type"] == "flow_prediction"
    assert wan["use_flow_sigmas"] is True
    assert wan["flow_shift"] == 3.0
    assert wan["solver_order"] == 2
    assert wan["solver_type"] == "bh2"
    assert wan["final_sigmas_type"] == "zero"
    qwen = json.loads((built["qwen-image"][0] / "scheduler" / "scheduler_config.json").read_text())
    expected = {
        "shift": 1.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 0.9,
        "base_image_seq_len": 256,
        "max_image_seq_len": 8192,
        "shift_terminal": 0.02,
        "time_shift_type": "exponential",
    }
    assert {k: qwen[k] for k in expected} == expected


def _assert_dtype_consistent(path: Path, dtype: str) -> None:
    for st in path.rglob("*.safetensors"):
        assert _safetensors_dtypes(st) == {_SAFETENSORS_DTYPE[dtype]}, st
    cfg = json.loads((path / "text_encoder" / "config.json").read_text())
    stack = [cfg]
    seen = 0
    while stack:
        node = stack.pop()
        for key, value in node.items():
            if key in ("dtype", "torch_dtype"):
                assert value == dtype, f"{key}={value} in text_encoder config"
                seen += 1
            elif isinstance(value, dict):
                stack.append(value)
    assert seen >= 1
    for cfg_path in path.rglob("config.json"):
        text = cfg_path.read_text()
        other = "float32" if dtype == "bfloat16" else "bfloat16"
        assert f'"{other}"' not in text, cfg_path
    assert model_info(path)["dtype"] == dtype


@pytest.mark.parametrize("model", MODELS)
def test_bf16_configs_consistent(built: dict[str, tuple[Path, Path]], model: str) -> None:
    _assert_dtype_consistent(built[model][0], "bfloat16")


def test_float32_variant(tmp_path: Path) -> None:
    path = build_tiny_model("qwen-image", tmp_path / "q32", dtype="float32")
    _assert_dtype_consistent(path, "float32")


def test_qwen_template_is_34_tokens(built: dict[str, tuple[Path, Path]]) -> None:
    from transformers import AutoTokenizer, Qwen2Tokenizer

    tok = Qwen2Tokenizer.from_pretrained(built["qwen-image"][0] / "tokenizer")
    prefix = QWEN_IMAGE_PROMPT_TEMPLATE.split("{}")[0]
    ids = tok(prefix)["input_ids"]
    assert len(ids) == QWEN_IMAGE_TEMPLATE_TOKENS == 34
    # The full template with a prompt: the prompt's tokens start exactly at index 34.
    full = tok(QWEN_IMAGE_PROMPT_TEMPLATE.format("a red cat"))["input_ids"]
    assert full[:34] == ids
    assert tok.decode(full[34:]).startswith("a red cat")
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
    # Loadable through AutoTokenizer too, and non-ASCII text still round-trips (byte fallback).
    auto = AutoTokenizer.from_pretrained(built["qwen-image"][0] / "tokenizer")
    assert auto.decode(auto("héllo wörld ☃")["input_ids"]) == "héllo wörld ☃"


def test_t5_tokenizer_covers_ascii(built: dict[str, tuple[Path, Path]]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["wan2.1-t2v"][0] / "tokenizer")
    text = "A cat, running! {x} #42 ~ ZQ_+|"
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text


def _finite_nondegenerate(x) -> None:
    import numpy as np

    x = np.asarray(x, dtype=np.float32)
    assert np.isfinite(x).all()
    assert x.std() > 1e-4  # not a constant image


def test_wan_generation(built: dict[str, tuple[Path, Path]]) -> None:
    pipe = diffusers.WanPipeline.from_pretrained(built["wan2.1-t2v"][0], dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"
    assert pipe.transformer.dtype == torch.float32 and pipe.text_encoder.dtype == torch.float32
    frames = pipe(
        "a cat running on the beach",
        negative_prompt="blurry, low quality",
        height=32,
        width=32,
        num_frames=5,
        num_inference_steps=2,
        guidance_scale=4.0,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).frames
    assert frames.shape == (1, 5, 32, 32, 3)
    _finite_nondegenerate(frames)


def test_qwen_image_generation(built: dict[str, tuple[Path, Path]]) -> None:
    pipe = diffusers.QwenImagePipeline.from_pretrained(built["qwen-image"][0], dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.prompt_template_encode_start_idx == 34
    images = pipe(
        "a red cat",
        negative_prompt="blurry",
        true_cfg_scale=4.0,
        height=32,
        width=32,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    assert images.shape == (1, 32, 32, 3)
    _finite_nondegenerate(images)


def _picture(seed: int, side: int = 64):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((side, side, 3)) * 255).astype("uint8"))


EDIT_MODELS = ("qwen-image-edit", "qwen-image-edit-plus")


@pytest.mark.parametrize("model", EDIT_MODELS)
def test_qwen_edit_template_prefix_is_64_tokens(built: dict[str, tuple[Path, Path]], model: str) -> None:
    """The edit pipelines drop the first 64 tokens (the system turn and ``<|im_start|>user\\n``), as the
    real tokenizer encodes them; the prompt's own tokens (and the image's, for Qwen-Image-Edit) follow."""
    from transformers import Qwen2Tokenizer, Qwen2VLProcessor

    path = built[model][0]
    # As vLLM-Omni's pipelines load them (from_pretrained_with_prefetch(..., subfolder="processor", ...)).
    processor = Qwen2VLProcessor.from_pretrained(str(path), subfolder="processor", local_files_only=True)
    tok = Qwen2Tokenizer.from_pretrained(str(path), subfolder="tokenizer", local_files_only=True)
    pipe = getattr(diffusers, PIPELINES[model]).from_pretrained(path, dtype=torch.float32)
    assert pipe.prompt_template_encode_start_idx == QWEN_IMAGE_EDIT_TEMPLATE_TOKENS == 64
    template = pipe.prompt_template_encode
    assert template.startswith(QWEN_IMAGE_EDIT_TEMPLATE_PREFIX)
    for t in (tok, processor.tokenizer):
        ids = t(QWEN_IMAGE_EDIT_TEMPLATE_PREFIX)["input_ids"]
        assert len(ids) == 64
        full = t(template.format("a red cat"))["input_ids"]
        assert full[:64] == ids
        assert t.decode(full[64:]) == template[len(QWEN_IMAGE_EDIT_TEMPLATE_PREFIX):].format("a red cat")
    assert processor.image_processor.patch_size == pipe.text_encoder.config.vision_config.patch_size == 14
    assert processor.image_processor.merge_size == pipe.text_encoder.config.vision_config.spatial_merge_size == 2


@pytest.mark.parametrize("model", EDIT_MODELS)
def test_qwen_image_edit_generation(built: dict[str, tuple[Path, Path]], model: str) -> None:
    pipe = getattr(diffusers, PIPELINES[model]).from_pretrained(built[model][0], dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    plus = model.endswith("-plus")
    # The vision tower reads the reference image: the prompt's embeddings (the 64-token prefix dropped)
    # hold its tokens and change with it.
    embeds = [pipe.encode_prompt("a red cat", image=[_picture(s)] if plus else _picture(s), device="cpu")[0]
              for s in (0, 1)]
    assert embeds[0].shape == embeds[1].shape and embeds[0].shape[1] > 8
    assert not torch.equal(embeds[0], embeds[1])
    images = pipe(
        image=_picture(0),
        prompt="make the cat red",
        negative_prompt="blurry",
        true_cfg_scale=4.0,
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images
    assert images.shape == (1, 64, 64, 3)
    _finite_nondegenerate(images)


def test_refuses_to_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError):
        build_tiny_model("qwen-image", out)
    assert (out / "keep.txt").read_text() == "user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp dir left behind

    path = build_tiny_model("qwen-image", out, overwrite=True)
    assert path == out.absolute()
    assert not (out / "keep.txt").exists() and (out / "model_index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert build_tiny_model("qwen-image", empty) == empty.absolute()
    assert (empty / INFO_FILE).is_file()

    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(FileExistsError):
        build_tiny_model("qwen-image", afile, overwrite=True)


@pytest.mark.parametrize(
    "kwargs",
    [{"model": "sd3"}, {"model": "qwen-image", "size": "huge"}, {"model": "qwen-image", "dtype": "int8"}],
)
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        build_tiny_model(out_dir=tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()
