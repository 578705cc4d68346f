"""vLLM-Omni's cache backends under omni-ext's TunedExecutor (issue 18 item 4), on real servers.

``--cache-backend`` is a server flag: the model runner of every worker wraps the transformer (cache-dit's
block cache, TeaCache's hook) and refreshes it per request. Under the TunedExecutor that runner is
vLLM-Omni's own, in each worker process, so a cached request gives the bytes vLLM-Omni's executor
gives on the same layout:

- ``cache_dit`` on tiny Wan with CFG 2 (the tuned pair, each rank one guidance branch, against
  vLLM-Omni's CFG 2) and on tiny Qwen-Image (one rank each);
- ``tea_cache`` on tiny Qwen-Image (vLLM-Omni 0.30 has TeaCache coefficients for Qwen-Image, none for
  Wan: both executors refuse Wan at start-up).

Each server logs that the backend was applied, so a pass is not a server that ran uncached. The
step-level preemption stays off under a cache backend (its per-request cache is state a pause cannot
save: ``omni_ext.executor.tuned.TunedExecutor._preempt_refusal``).
"""

from __future__ import annotations

import json
import re

import pytest

from omni_ext.scheduler.cost import CACHE_SPEEDUP
from tests.helpers import FLOAT32, png_from, image_gen, video_sync

TUNED = "omni_ext.executor.TunedExecutor"
#: Enough steps that the caches skip work (cache-dit's default warm-up is 8 computed steps).
STEPS = 16


#: The tuned Qwen-Image servers' cost seed, as a preset (measured without a cache) would write it.
SEED = {"omni_ext": {"scheduler": {"seconds_per_unit": 0.002}}}


def _pair(args: list[str], seed: bool = False) -> dict:
    extra = ["--additional-config", json.dumps(SEED)] if seed else []
    return {"stock": (args, {}), "tuned": ([*args, "--distributed-executor-backend", TUNED, *extra], {})}


@pytest.mark.server
@pytest.mark.own_servers("wan2.1-t2v", _pair(["--cfg-parallel-size", "2", "--cache-backend", "cache_dit", *FLOAT32]))
def test_cache_dit_on_a_wan_cfg_pair_is_byte_identical_to_vllm_omnis_executor(own) -> None:
    stock, tuned = own["stock"], own["tuned"]
    for server in (stock, tuned):
        assert "Cache-dit enabled successfully on" in server.log_text(), server.log_tail()
        # the tuned pipeline gets cache-dit's Wan2.2 set-up, as vLLM-Omni's own class does
        assert "Using custom cache-dit enabler for model: Wan22Pipeline" in server.log_text(), server.log_tail()
    a = video_sync(stock, size="32x32", num_frames=5, num_inference_steps=STEPS, seed=5)
    b = video_sync(tuned, size="32x32", num_frames=5, num_inference_steps=STEPS, seed=5)
    assert a.status_code == b.status_code == 200, (a.text[:300], b.text[:300])
    assert a.content == b.content
    assert "step-level preemption is off: cache backend 'cache_dit'" in tuned.log_text()


@pytest.mark.server
@pytest.mark.parametrize("applied", [
    pytest.param("Cache-dit enabled successfully on", id="cache_dit",
                 marks=pytest.mark.own_servers("qwen-image", _pair(["--cache-backend", "cache_dit"], seed=True))),
    pytest.param("TeaCache", id="tea_cache",
                 marks=pytest.mark.own_servers("qwen-image", _pair(["--cache-backend", "tea_cache"], seed=True))),
])
def test_qwen_image_cache_backends_are_byte_identical_to_vllm_omnis_executor(own, applied: str, request) -> None:
    stock, tuned = own["stock"], own["tuned"]
    for server in (stock, tuned):
        assert applied in server.log_text(), server.log_tail()
    # a cached run costs less: the seed the scheduler starts from is the preset's over the backend's speed-up
    backend = request.node.callspec.id
    seed = SEED["omni_ext"]["scheduler"]["seconds_per_unit"] / CACHE_SPEEDUP[backend]
    shown = re.search(rf"seed ([\d.e-]+) s/unit \(for cache backend {backend}\)", tuned.log_text())
    assert shown and float(shown.group(1)) == pytest.approx(seed), tuned.log_tail()
    body = {"size": "32x32", "num_inference_steps": STEPS, "seed": 9}
    assert png_from(image_gen(tuned, **body)) == png_from(image_gen(stock, **body))
