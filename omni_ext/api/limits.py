"""Every numeric bound on a request field of omni-ext's routes, declared once.

The request checks (:mod:`omni_ext.api.intake`), the routes and the OpenAPI schemas
(:mod:`omni_ext.api.schemas`) all read these names, so what the schema documents is what the
server enforces (``tests/test_api_units.py`` checks both against each other). Bounds that depend
on the served model (the spatial multiple, a scheduler's minimum step count) come from
:func:`omni_ext.api.validation.limits_for_model` instead.

Pure constants: importable without FastAPI or vLLM-Omni.
"""

from __future__ import annotations

#: Denoise steps on every route that omni-ext validates (the model may need more than one: see
#: ``ModelLimits.min_steps``).
MIN_STEPS = 1
MAX_STEPS = 1000
#: ``/v1/videos`` builds vLLM-Omni 0.30's ``VideoGenerationRequest``, whose own bounds are stricter
#: than ours (``num_inference_steps <= 200``; every guidance scale ``<= 20``); these mirror them so
#: that the schema tells the truth. A unit test reads them back from vLLM-Omni's model.
MAX_VIDEO_STEPS = 200
MAX_VIDEO_GUIDANCE = 20.0

#: Characters of a ``prompt`` (and of a ``negative_prompt`` or ``system_prompt``): generous (the text
#: encoders read at most 512-1024 tokens) but finite, so that a megabyte prompt is refused before it is
#: stored with its job and echoed back by every GET and list.
MAX_PROMPT_CHARS = 20_000
#: Tokens of the same fields, counted with the served model's own tokenizer where it is at hand
#: (:mod:`omni_ext.api.tokens`): the text encoders read 512-1024 of them, so this too is generous.
MAX_PROMPT_TOKENS = 4096
#: OpenAI's image ``quality`` as a fraction of the served model's native denoising steps (its family's;
#: at least the model's minimum): fewer steps are what "low" costs less with on a diffusion model. A
#: request's own ``num_inference_steps`` wins, and ``quality`` is then reported as not applied.
QUALITY_STEPS = {"low": 0.25, "medium": 0.5, "standard": 0.5, "high": 1.0, "hd": 1.0}
#: The end user's id a request may carry (``user``, and its successor ``safety_identifier``): recorded, bounded.
MAX_USER_CHARS = 256
MAX_FRAMES = 2049  # ``num_frames`` of a video
MAX_OUTPUTS = 10  # images per request (``n``)
MAX_PIXELS = 7680 * 4320  # width x height
SIZE_DIGITS = 5  # at most this many digits per side in ``size=WIDTHxHEIGHT``

#: OpenAI's ``seconds`` (a string), mapped to frames at the model's fps.
MAX_SECONDS = 60
MAX_FPS = 240  # ``fps`` of a video
#: Seeds every generator accepts (NumPy's legacy seeding stops at 2**32 - 1); random seeds are drawn
#: from the same range.
MAX_SEED = 2**32 - 1
MAX_COMPRESSION = 100  # ``output_compression`` of jpeg/webp images, OpenAI's 0-100
MAX_PAGE = 100  # ``limit`` of ``GET /v1/videos``
MAX_PLACEMENTS_PAGE = 1000  # ``limit`` of ``GET /v1/omni_ext/placements``
#: ``priority`` of a generation (vLLM's convention: lower runs earlier, default 0). Bounded so that
#: aging (one step per ``aging_s`` waited) lifts any job to the front within a known time.
MIN_PRIORITY = -1000
MAX_PRIORITY = 1000

# ---- Bodies and slow clients: the defaults of the ``omni_ext.api`` settings named (:mod:`omni_ext.api.bodies`) ----
#: Upload bytes of one request body (``max_upload_mb``): past it, 413 before the rest is read.
MAX_UPLOAD_MB = 32
#: Request bodies held in memory at once on omni-ext's upload routes (``max_body_memory_mb``), reserved
#: by each body's declared length (the upload limit when it declares none) before a byte of it is read.
MAX_BODY_MEMORY_MB = 256
#: How long a body waits for room in that budget (``body_wait_s``) before a 503 + ``Retry-After``.
BODY_WAIT_S = 10.0
#: From connection (or the end of the previous response) to the end of a request's headers
#: (``header_timeout_s``): past it, 408 and the connection closes.
HEADER_TIMEOUT_S = 30.0
#: The longest silence inside a body, and the time a body may take on top of its bytes at the minimum
#: rate (``body_timeout_s``): past either, 408 and the connection closes.
BODY_TIMEOUT_S = 30.0
#: The slowest sustained upload accepted (``body_min_rate_kib_s``, KiB/s): a 32 MiB body gets 30 s + 512 s.
BODY_MIN_RATE_KIB_S = 64.0
