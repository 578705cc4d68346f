"""Prompts counted in the served model's own tokens (the bound is :data:`omni_ext.api.limits.MAX_PROMPT_TOKENS`).

A character bound (:data:`~omni_ext.api.limits.MAX_PROMPT_CHARS`) is the same for every model and
every script, but what a text encoder reads is tokens: 20,000 characters of Chinese are about as many
tokens, of English a quarter of that. Where the served model's tokenizer is at hand (its
``tokenizer/`` folder, in the model's folder or a hub id's snapshot) and is a fast (Rust) one, it is
loaded once at start-up and each prompt field is counted with it before a job exists; a slow
tokenizer would make the count itself a cost on the event loop, so then only characters are bounded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from omni_ext.api.limits import MAX_PROMPT_TOKENS

logger = logging.getLogger("omni_ext.api")

#: The request fields counted (the same as the character bound's).
PROMPT_FIELDS = ("prompt", "negative_prompt", "system_prompt")


@dataclass(frozen=True)
class PromptTokens:
    """The served model's tokenizer, and the bound its prompts are held to."""

    tokenizer: Any
    source: str
    bound: int = MAX_PROMPT_TOKENS

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False, truncation=False)["input_ids"])

    def over(self, fields: dict[str, Any]) -> tuple[str, int] | None:
        """The first prompt field of ``fields`` over the bound, with its token count; None when all fit."""
        for name in PROMPT_FIELDS:
            value = fields.get(name)
            # a token is at least one byte of UTF-8 (byte-level BPE; SentencePiece may add one word mark)
            if isinstance(value, str) and len(value.encode("utf-8", "surrogatepass")) + 1 > self.bound:
                n = self.count(value)
                if n > self.bound:
                    return name, n
        return None


def load(model_path: str) -> PromptTokens | None:
    """The served model's fast tokenizer (start-up work: never on the request path), or None."""
    from omni_ext.models import registry

    root = registry.model_root(model_path)
    folder = root / "tokenizer" if root is not None else None
    if folder is None or not folder.is_dir():
        logger.info("omni-ext API: prompts bounded in characters only (%s has no tokenizer folder on disk)", model_path)
        return None
    t0 = time.monotonic()
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder), use_fast=True)
    except Exception as exc:  # a tokenizer transformers cannot load here: the character bound still holds
        logger.warning("omni-ext API: prompts bounded in characters only (the tokenizer in %s did not load: %s)",
                       folder, exc)
        return None
    if not getattr(tokenizer, "is_fast", False):
        logger.info("omni-ext API: prompts bounded in characters only (%s is not a fast tokenizer)", folder)
        return None
    tokenizer.model_max_length = 1 << 30  # counting, not encoding: no "sequence longer than" warning
    logger.info("omni-ext API: prompts bounded to %d tokens of %s (loaded in %.2f s)", MAX_PROMPT_TOKENS,
                type(tokenizer).__name__, time.monotonic() - t0)
    return PromptTokens(tokenizer, str(folder))
