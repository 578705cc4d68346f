"""Deterministic tiny random-weight diffusers pipelines (Wan2.1-T2V and Qwen-Image), built offline.

Why this exists: the serving stack, its scheduler and its tests need real pipeline folders with the
*real* class names and folder layout (so vLLM-Omni picks the same code paths as for
``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` and ``Qwen/Qwen-Image``), but this project runs on CPU-only
machines with no hub access. So we build the same architectures at toy sizes, with seeded random
weights and hand-made tokenizers, and save them with ``save_pretrained`` in diffusers format.

Design rules (each one answers a failure we want to avoid):

* **Byte-identical rebuilds.** Every weight is drawn from a per-component seed inside a forked RNG,
  tokenizers are built from a word list in this file (no training data, no randomness), and nothing
  written depends on time or on the temp path. Tests and caches can then compare folders by hash.
* **Consistent dtypes.** All weights are saved in one dtype and every transformers config records it
  (``dtype``/``torch_dtype``). Serving in bf16 failed when the text-encoder config said float32 while
  the rest was bf16, so there is exactly one source of truth: the ``dtype`` argument.
* **Atomic output.** The folder is assembled in a temp dir next to ``out_dir`` and renamed into
  place, so a crash or a concurrent reader never sees a half-written model.
* **Cheap import.** torch/diffusers/transformers are imported inside the functions, so importing this
  module (e.g. for ``omni-ext --help``) costs nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "PIPELINES", "RELABELLED", "TAKES_IMAGE", "SIZES", "ONLY_FOR", "DTYPES", "INFO_FILE", "build_tiny_model", "model_info",
           "relabel"]

MODELS: tuple[str, ...] = ("wan2.1-t2v", "wan2.2-i2v", "wan2.2-ti2v", "qwen-image", "qwen-image-edit",
                          "qwen-image-edit-plus")
#: The pipeline class each tiny model is built as (its ``model_index.json`` ``_class_name``, the
#: vLLM-Omni registry key it is served by): what ``omni-ext models`` says each class is tested on.
PIPELINES: dict[str, str] = {"wan2.1-t2v": "WanPipeline", "wan2.2-i2v": "WanImageToVideoPipeline",
                             "wan2.2-ti2v": "WanPipeline", "qwen-image": "QwenImagePipeline",
                             "qwen-image-edit": "QwenImageEditPipeline",
                             "qwen-image-edit-plus": "QwenImageEditPlusPipeline"}
#: Other registered classes on a tiny model's architecture: the suite serves the tiny model relabelled as
#: each (its ``model_index.json`` ``_class_name``; tests/test_registry_models.py), class -> tiny model.
RELABELLED: dict[str, str] = {"WanDMDPipeline": "wan2.1-t2v", "WanT2VDMD2Pipeline": "wan2.1-t2v",
                              "QwenImageDMD2Pipeline": "qwen-image"}
#: Tiny models whose requests carry a reference image (benchmarks send one with each request).
TAKES_IMAGE: tuple[str, ...] = ("wan2.2-i2v", "wan2.2-ti2v", "qwen-image-edit", "qwen-image-edit-plus")
SIZES: tuple[str, ...] = ("tiny", "small", "med", "1.3b")
#: Sizes only some models have: ``1.3b`` is Wan2.1-T2V-1.3B's transformer at full width and depth.
ONLY_FOR: dict[str, tuple[str, ...]] = {"1.3b": ("wan2.1-t2v",)}
DTYPES: tuple[str, ...] = ("bfloat16", "float32")

#: Small marker file written next to ``model_index.json``; diffusers ignores unknown root files.
INFO_FILE = "omni_ext_tiny.json"
_INFO_FORMAT = 1

# Per-component seeds: fixed so that rebuilding gives the same bytes, different so that components
# do not share weight patterns.
_SEED_TEXT_ENCODER = 1000
_SEED_TRANSFORMER = 2000
_SEED_VAE = 3000
_SEED_TRANSFORMER_2 = 2001  # Wan2.2 A14B's low-noise expert

# ---------------------------------------------------------------------------------------------------
# Size presets. Only the denoising transformer scales with ``size`` (it is what step-time benchmarks
# measure); the text encoder and VAE stay small because they run once per request and a wide CPU
# conv3d VAE would dominate wall time. The VAE keeps the real topology: 8x spatial and 4x temporal
# downsampling with z_dim 16, so latent shapes match the real models.
# ---------------------------------------------------------------------------------------------------
_WAN_TRANSFORMER: dict[str, dict[str, int]] = {
    "tiny": {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 12, "ffn_dim": 32},
    "small": {"num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 32, "ffn_dim": 512},
    "med": {"num_layers": 8, "num_attention_heads": 8, "attention_head_dim": 32, "ffn_dim": 1024},
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers' transformer/config.json: dim 1536 = 12 heads x 128, FFN 8960, 30
    # layers (its text_dim stays the tiny encoder's: the cross-attention's key/value projections are
    # 32 -> 1536 instead of 4096 -> 1536, 0.3 % of the weights)
    "1.3b": {"num_layers": 30, "num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960},
}
# axes_dims_rope must sum to attention_head_dim (each entry even), like (16, 56, 56) for the real 128.
_QWEN_TRANSFORMER: dict[str, dict[str, Any]] = {
    "tiny": {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16, "axes_dims_rope": (8, 4, 4)},
    "small": {"num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 32, "axes_dims_rope": (8, 12, 12)},
    "med": {"num_layers": 8, "num_attention_heads": 8, "attention_head_dim": 32, "axes_dims_rope": (8, 12, 12)},
}
_TEXT_DIM = 32  # hidden size of both tiny text encoders (= transformer text_dim / joint_attention_dim)

# Real Qwen2/Qwen2.5-VL special tokens, in their real order (ids 151643..151656 in the real vocab).
_QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

#: The system prompt QwenImagePipeline wraps around every prompt; the pipeline drops the first
#: ``prompt_template_encode_start_idx`` (= 34) tokens, so our tokenizer must encode the prefix
#: (everything before ``{}``) to exactly 34 tokens, as the real tokenizer does.
QWEN_IMAGE_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
    "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
    "<|im_end|>\n<|im_start|>assistant\n"
)
QWEN_IMAGE_TEMPLATE_TOKENS = 34

#: The system turn and user-turn opening of the prompt template of QwenImageEditPipeline and
#: QwenImageEditPlusPipeline (diffusers' and vLLM-Omni's): both drop the first
#: ``prompt_template_encode_start_idx`` (= 64) tokens, which the real tokenizer makes of exactly this
#: text (then come the image's vision tokens and the user's prompt). The edit models' tokenizer learns
#: each of its pre-tokenizer pieces (``" ("``, ``"),"``, ``"'s"``, the words) as one token, so it
#: encodes to exactly 64 tokens, as the real one does.
QWEN_IMAGE_EDIT_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n"
)
QWEN_IMAGE_EDIT_TEMPLATE_TOKENS = 64

#: Qwen2.5-VL's image preprocessing, as in the ``processor/preprocessor_config.json`` of Qwen/Qwen-Image-Edit
#: (14-pixel patches, 2x2 merge, 2-frame temporal patches, CLIP mean/std, 56x56 to 3584x3584 pixels); the
#: tiny text encoder's vision tower is configured to match.
_QWEN_VL_IMAGE_PROCESSOR: dict[str, Any] = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "min_pixels": 3136,
    "max_pixels": 12845056,
}

# Whole-word vocabulary shared by both tokenizers. Hand-written (no corpus download): common English
# words, typical prompt words, and every word of the Qwen-Image template so that it tokenizes like the
# real tokenizer (one token per word). Order matters for ids; only append to keep ids stable.
_WORDS_TEXT = """
the a an and or but of to in on at by for with from into over under above below between through
is are was were be been being has have had do does did will would can could should may might must
it its this that these those there here what which who whom whose when where why how all any both
each few more most other some such no nor not only own same so than too very just also then now
i you he she we they me him her us them my your his our their mine yours
one two three four five six seven eight nine ten first second third last next many much little
describe image by detailing color shape size texture quantity text spatial relationships objects
background system user assistant picture photo video frame scene style view camera light shadow
red orange yellow green blue purple pink brown black white gray grey gold silver dark bright
big small large tiny tall short long wide narrow round square flat smooth rough soft hard
cat dog bird fish horse cow sheep lion tiger bear fox wolf rabbit mouse duck owl eagle dragon
man woman boy girl child people person face eyes hair hand hands smile portrait crowd
tree trees flower flowers grass forest mountain mountains river lake sea ocean beach sky cloud
clouds sun moon star stars rain snow fire water wind storm sunset sunrise night day morning
city street road house building bridge tower castle car train boat ship plane bike window door
room table chair bed book cup glass bottle food apple cake bread coffee tea
running walking flying swimming sitting standing jumping dancing playing eating looking holding
beautiful cute happy sad old young new quiet calm cinematic realistic detailed high quality
low blurry static noisy sharp clear vivid colorful painting drawing sketch art digital render
close up wide shot slow motion zoom pan moving fast gentle warm cold hot wet dry
astronaut robot space planet earth garden park field farm village island desert jungle
pixel pixels noise random test sample hello world prompt negative positive good bad best worst
left right top bottom center front back side inside outside near far around across along
make made take took see seen look show shows showing go going come coming turn turning
"""


def _words() -> tuple[str, ...]:
    """The word list, de-duplicated in first-seen order (stable ids across rebuilds)."""
    return tuple(dict.fromkeys(_WORDS_TEXT.split()))


def _round_up(n: int, multiple: int = 64) -> int:
    """Embedding tables are rounded up like real checkpoints (and for tidy tensor shapes)."""
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------
def build_t5_tokenizer() -> Any:
    """A small SentencePiece-Unigram T5 tokenizer built from a hand-written vocab.

    Why hand-written: training a real ``spiece.model`` needs a corpus, leaves unseen characters as
    ``<unk>`` and loading it needs protobuf. Here every printable ASCII character exists both as a
    word-initial piece (``▁c``) and a continuation piece (``c``), so any ASCII text encodes without
    ``<unk>``; whole words get a much better score so common words are single tokens.
    """
    from transformers import T5Tokenizer

    pieces: dict[str, float] = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0}
    for word in _words():
        pieces.setdefault("\u2581" + word, -6.0)
    pieces.setdefault("\u2581", -14.0)
    for code in range(33, 127):  # printable ASCII without the space (spaces become '▁')
        pieces.setdefault("\u2581" + chr(code), -12.0)
        pieces.setdefault(chr(code), -13.0)
    return T5Tokenizer(vocab=list(pieces.items()), extra_ids=0, model_max_length=512)


def build_qwen2_tokenizer(texts: tuple[str, ...] = ()) -> Any:
    """A byte-level BPE ``Qwen2Tokenizer`` with the real Qwen pre-tokenizer and special tokens.

    Why: QwenImagePipeline hard-codes ``prompt_template_encode_start_idx = 34``, i.e. it assumes the
    real tokenizer's segmentation of its system prompt. We train BPE (deterministic, no randomness)
    on our word list in the forms the pre-tokenizer produces (``word``, `` word``, ``Word``,
    `` Word``) until each is one token, so the template prefix encodes to exactly 34 tokens and the
    pipeline drops exactly the template. Anything else still encodes, byte by byte if need be.

    ``texts``: more template text to learn, each of its pre-tokenizer pieces as one token (its special
    tokens left out): the edit models' system prompt (:data:`QWEN_IMAGE_EDIT_TEMPLATE_PREFIX`). None by
    default, so the Qwen-Image tokenizer is unchanged.
    """
    import re

    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=100_000,  # never reached: training stops once every training word is one token
        min_frequency=0,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    corpus: list[str] = []
    for word in _words():
        for form in (word, word.capitalize()):
            corpus.extend((form, " " + form))
    special = re.compile("|".join(re.escape(t) for t in _QWEN_SPECIAL_TOKENS))
    corpus.extend(part for text in texts for part in special.split(text) if part)
    bpe.train_from_iterator(corpus, trainer=trainer)

    model_json = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(sorted(model_json["vocab"].items(), key=lambda kv: kv[1]))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]]
    for token in _QWEN_SPECIAL_TOKENS:  # appended last, in the real order
        vocab[token] = len(vocab)

    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
    )
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False, lstrip=False, rstrip=False) for t in _QWEN_SPECIAL_TOKENS],
        special_tokens=True,
    )
    for token in _QWEN_SPECIAL_TOKENS:  # adding must reuse the vocab ids, not append duplicates
        if tok.convert_tokens_to_ids(token) != vocab[token]:
            raise RuntimeError(f"special token {token!r} got id {tok.convert_tokens_to_ids(token)}")
    return tok


# ---------------------------------------------------------------------------------------------------
# Components
# ---------------------------------------------------------------------------------------------------
def _seeded(seed: int, factory: Any) -> Any:
    """Build one component from a fixed seed without disturbing the caller's global RNG state."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


def wan_vae() -> Any:
    """The tiny Wan VAE (the one in every tiny Wan model; unit tests of the VAE decode build it alone)."""
    from diffusers import AutoencoderKLWan

    return _seeded(
        _SEED_VAE,
        lambda: AutoencoderKLWan(
            base_dim=4,
            z_dim=16,
            dim_mult=[1, 2, 2, 2],  # 3 downsamples: 8x spatial
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=[False, True, True],  # 4x temporal, as in the real VAE
        ),
    )


def wan_transformer(size: str, *, in_channels: int = 16, out_channels: int = 16, seed: int = _SEED_TRANSFORMER) -> Any:
    """The tiny Wan transformer of preset ``size`` (also built alone by ``omni_ext.device_probe``).

    The channel counts are the real models': 16/16 for T2V, 36/16 for I2V (16 noise + 4 mask + 16
    image-latent channels), 48/48 for TI2V-5B (the Wan2.2 VAE's z_dim)."""
    from diffusers import WanTransformer3DModel

    return _seeded(
        seed,
        lambda: WanTransformer3DModel(
            patch_size=(1, 2, 2),
            in_channels=in_channels,
            out_channels=out_channels,
            text_dim=_TEXT_DIM,
            freq_dim=256,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
            **_WAN_TRANSFORMER[size],
        ),
    )


def wan22_vae() -> Any:
    """The tiny Wan2.2 VAE of TI2V-5B: residual, 2x2 patchified input (12 channels), z_dim 48, 16x
    spatial and 4x temporal compression, as in Wan-AI/Wan2.2-TI2V-5B-Diffusers. Its latent statistics
    are 0/1 (the real ones are measured on real videos, meaningless for random weights)."""
    from diffusers import AutoencoderKLWan

    return _seeded(
        _SEED_VAE,
        lambda: AutoencoderKLWan(
            base_dim=8,
            decoder_base_dim=8,
            z_dim=48,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=[False, True, True],
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            scale_factor_temporal=4,
            latents_mean=[0.0] * 48,
            latents_std=[1.0] * 48,
        ),
    )


def wan_scheduler() -> Any:
    """The scheduler config shipped with Wan2.1-T2V-1.3B-Diffusers."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        solver_order=2,
        solver_type="bh2",
        final_sigmas_type="zero",
        num_train_timesteps=1000,
        predict_x0=True,
        lower_order_final=True,
    )


def _wan_components(size: str, model: str = "wan2.1-t2v") -> dict[str, Any]:
    """Wan parts named and wired as in the real Diffusers repos, at toy size: ``wan2.1-t2v`` as
    Wan-AI/Wan2.1-T2V-1.3B (WanPipeline); ``wan2.2-i2v`` as Wan-AI/Wan2.2-I2V-A14B (WanImageToVideoPipeline:
    two experts switched at ``boundary_ratio`` 0.9, the image enters as VAE latents, no CLIP encoder);
    ``wan2.2-ti2v`` as Wan-AI/Wan2.2-TI2V-5B (WanPipeline with ``expand_timesteps``: text-to-video, or
    image-to-video when a request carries an image; the Wan2.2 VAE)."""
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_t5_tokenizer()
    te_config = UMT5Config(
        vocab_size=_round_up(len(tokenizer)),
        d_model=_TEXT_DIM,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    text_encoder = _seeded(_SEED_TEXT_ENCODER, lambda: UMT5EncoderModel(te_config))
    parts: dict[str, Any] = {"tokenizer": tokenizer, "text_encoder": text_encoder, "scheduler": wan_scheduler()}
    if model == "wan2.2-i2v":
        parts["transformer"] = wan_transformer(size, in_channels=36)
        parts["transformer_2"] = wan_transformer(size, in_channels=36, seed=_SEED_TRANSFORMER_2)
        parts["vae"] = wan_vae()
        parts["boundary_ratio"] = 0.9
    elif model == "wan2.2-ti2v":
        parts["transformer"] = wan_transformer(size, in_channels=48, out_channels=48)
        parts["vae"] = wan22_vae()
        parts["expand_timesteps"] = True
    else:
        parts["transformer"] = wan_transformer(size)
        parts["vae"] = wan_vae()
    return parts


def _qwen_components(size: str, tokenizer: Any = None) -> dict[str, Any]:
    """QwenImagePipeline parts named and wired as in Qwen/Qwen-Image, at toy size (``tokenizer``:
    another :func:`build_qwen2_tokenizer`, else the Qwen-Image one)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = tokenizer if tokenizer is not None else build_qwen2_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_SPECIAL_TOKENS}
    te_config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": _round_up(len(tokenizer)),
            "hidden_size": _TEXT_DIM,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 128000,
            "rms_norm_eps": 1e-6,
            # mrope_section must sum to head_dim / 2 = 8 (the real one is [16, 24, 24] for 128).
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": _TEXT_DIM,
            "fullatt_block_indexes": [1],
            # The real Qwen2.5-VL patching, as the edit models' processor cuts images
            # (_QWEN_VL_IMAGE_PROCESSOR); in_channels is transformers 5's name of in_chans.
            "patch_size": _QWEN_VL_IMAGE_PROCESSOR["patch_size"],
            "spatial_merge_size": _QWEN_VL_IMAGE_PROCESSOR["merge_size"],
            "temporal_patch_size": _QWEN_VL_IMAGE_PROCESSOR["temporal_patch_size"],
            "in_channels": 3,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    text_encoder = _seeded(_SEED_TEXT_ENCODER, lambda: Qwen2_5_VLForConditionalGeneration(te_config))
    transformer = _seeded(
        _SEED_TRANSFORMER,
        lambda: QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,  # 16 latent channels x 2x2 packing
            out_channels=16,
            joint_attention_dim=_TEXT_DIM,
            guidance_embeds=False,
            **_QWEN_TRANSFORMER[size],
        ),
    )
    vae = _seeded(
        _SEED_VAE,
        lambda: AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=16,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            attn_scales=[],
            temperal_downsample=[False, True, True],
        ),
    )
    # The scheduler config shipped with Qwen/Qwen-Image.
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
        invert_sigmas=False,
        stochastic_sampling=False,
    )
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "transformer": transformer,
        "vae": vae,
        "scheduler": scheduler,
    }


def _qwen_edit_components(size: str) -> dict[str, Any]:
    """QwenImageEditPipeline / QwenImageEditPlusPipeline parts as in Qwen/Qwen-Image-Edit(-2509/-2511):
    Qwen-Image's (the same seeds; the text encoder's vision tower now sees the reference image) with
    a tokenizer that also learnt the edit template, and the ``processor`` the pipelines feed the
    reference image and the prompt through (a ``Qwen2VLProcessor`` built here, no hub)."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tokenizer = build_qwen2_tokenizer((QWEN_IMAGE_EDIT_TEMPLATE_PREFIX,))
    parts = _qwen_components(size, tokenizer)
    # transformers 5's Qwen2VLProcessor requires a video processor (the real folder has one); never used here.
    vl = {k: _QWEN_VL_IMAGE_PROCESSOR[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "image_mean",
                                                    "image_std")}
    parts["processor"] = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**_QWEN_VL_IMAGE_PROCESSOR),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**vl),
    )
    return parts


# ---------------------------------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------------------------------
def _set_config_dtype(config: Any, dtype_name: str) -> None:
    """Record the saved dtype on a transformers config and all its sub-configs.

    Why: vLLM-Omni/transformers read this field to pick the load dtype; a stale ``float32`` on the
    text encoder next to bf16 weights broke bf16 serving.
    """
    import torch

    config.dtype = getattr(torch, dtype_name)
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            _set_config_dtype(sub, dtype_name)


def _normalise_json(path: Path, tmp_root: Path) -> None:
    """Drop keys that would leak the temp dir (``_name_or_path`` and friends) into saved configs."""
    text = path.read_text(encoding="utf-8")
    if str(tmp_root) not in text and tmp_root.name not in text:
        return
    data = json.loads(text)

    def scrub(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {
                k: scrub(v)
                for k, v in obj.items()
                if not (isinstance(v, str) and (str(tmp_root) in v or tmp_root.name in v))
            }
        if isinstance(obj, list):
            return [scrub(v) for v in obj]
        return obj

    path.write_text(json.dumps(scrub(data), indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_pipeline(model: str, size: str, dtype_name: str, target: Path) -> None:
    """Build all components, save them with ``save_pretrained`` into ``target`` and tidy the result."""
    import torch
    from diffusers import QwenImagePipeline, WanImageToVideoPipeline, WanPipeline

    torch_dtype = getattr(torch, dtype_name)
    if model.startswith("wan"):
        components = _wan_components(size, model)
        pipe = (WanImageToVideoPipeline if PIPELINES[model] == "WanImageToVideoPipeline" else WanPipeline)(**components)
    elif model.startswith("qwen-image-edit"):
        import diffusers

        components = _qwen_edit_components(size)
        pipe = getattr(diffusers, PIPELINES[model])(**components)
    else:
        components = _qwen_components(size)
        pipe = QwenImagePipeline(**components)
    for name in ("text_encoder", "transformer", "transformer_2", "vae"):
        if name not in components:
            continue
        # Plain nn.Module.to: diffusers' override warns about _keep_in_fp32_modules, which only
        # matter at load time (from_pretrained upcasts them again); we want everything in one dtype.
        torch.nn.Module.to(components[name], torch_dtype)
    # diffusers model configs carry no dtype field; the transformers one does (and must match).
    _set_config_dtype(components["text_encoder"].config, dtype_name)
    pipe.save_pretrained(str(target), safe_serialization=True)

    index_path = target / "model_index.json"
    index = json.loads(index_path.read_text(encoding="utf-8"))
    if model.startswith("wan"):
        # transformers 5 aliases T5TokenizerFast to T5Tokenizer, so save_pretrained records
        # "T5Tokenizer"; the real repo names "T5TokenizerFast" and that still loads.
        index["tokenizer"] = ["transformers", "T5TokenizerFast"]
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    info = {"format": _INFO_FORMAT, "model": model, "size": size, "dtype": dtype_name, "builder": __name__}
    (target / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    for path in sorted(target.rglob("*.json")):
        _normalise_json(path, target)
    # Some savers write 0600 files (atomic temp-file writes); make the folder plainly readable.
    for path in target.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)


def build_tiny_model(
    model: str,
    out_dir: str | os.PathLike[str],
    size: str = "tiny",
    dtype: str = "bfloat16",
    *,
    overwrite: bool = False,
) -> Path:
    """Build a deterministic random-weight pipeline in diffusers format at out_dir (absolute path returned).

    ``model`` is one of :data:`MODELS`, ``size`` one of :data:`SIZES` (only the denoising transformer
    grows), ``dtype`` one of :data:`DTYPES` (every component's weights and configs use it). Running
    it twice with the same arguments gives byte-identical files. The folder is built in a temp dir
    beside ``out_dir`` and renamed into place; an existing non-empty ``out_dir`` is refused unless
    ``overwrite=True`` (then it is replaced only after the new build succeeded).
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if model not in ONLY_FOR.get(size, MODELS):
        raise ValueError(f"size {size!r} exists for {', '.join(ONLY_FOR[size])} only, not {model!r}")

    out = Path(out_dir).expanduser().absolute()
    _check_target(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        _write_pipeline(model, size, dtype, tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a model folder should be as readable as a normal dir
        _check_target(out, overwrite)  # re-check: someone may have written there while we built
        old: Path | None = None
        if out.exists():
            if any(out.iterdir()):
                old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
                os.replace(out, old / "x")
            else:
                out.rmdir()
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_target(out: Path, overwrite: bool) -> None:
    """Refuse to clobber user data: only an absent/empty dir, or ``overwrite=True``, is acceptable."""
    if not out.exists():
        return
    if not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if not overwrite and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty; pass overwrite=True to replace it")


def relabel(model: str | os.PathLike[str], dest: str | os.PathLike[str], cls: str, extra: dict[str, Any] | None = None) -> Path:
    """A copy of a tiny model folder (weights linked, not copied) whose ``model_index.json`` names ``cls``
    (plus ``extra`` keys): the tiny model served as another registered class on its architecture
    (:data:`RELABELLED`). An existing ``dest`` is replaced."""
    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(model, dest, symlinks=True)
    index = json.loads((dest / "model_index.json").read_text())
    (dest / "model_index.json").write_text(json.dumps({**index, "_class_name": cls, **(extra or {})}, indent=2))
    return dest


def model_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Describe a pipeline folder: ``{"pipeline", "model", "size", "dtype"}``.

    ``pipeline`` comes from ``model_index.json`` (so it works for any diffusers folder); ``model``,
    ``size`` and ``dtype`` come from the marker file written by :func:`build_tiny_model` and are
    ``None`` for folders not built here.
    """
    root = Path(path)
    index = json.loads((root / "model_index.json").read_text(encoding="utf-8"))
    info_path = root / INFO_FILE
    info: dict[str, Any] = json.loads(info_path.read_text(encoding="utf-8")) if info_path.is_file() else {}
    return {
        "pipeline": index.get("_class_name"),
        "model": info.get("model"),
        "size": info.get("size"),
        "dtype": info.get("dtype"),
    }
