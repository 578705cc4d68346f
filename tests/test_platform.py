"""The CPU platform's decisions and figures (pure logic; the serving tests run it for real)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_ext.platform import detect, memory, threads


@pytest.mark.parametrize(
    "env,expected",
    [({}, "auto"), ({"OMNI_EXT_CPU_PLATFORM": "0"}, "0"), ({"OMNI_EXT_CPU_PLATFORM": "off"}, "0"),
     ({"OMNI_EXT_CPU_PLATFORM": "1"}, "1"), ({"OMNI_EXT_CPU_PLATFORM": "weird"}, "auto")],
)
def test_switch_values(env: dict[str, str], expected: str) -> None:
    assert detect.switch_value(env) == expected


@pytest.mark.parametrize("node,kind", [("davinci0", "npu"), ("nvidia0", "cuda")])
def test_steps_aside_when_an_accelerator_is_present(tmp_path: Path, node: str, kind: str) -> None:
    (tmp_path / node).touch()
    assert detect.accelerator_present(tmp_path, check_torch=False) == kind
    assert detect.cpu_platform_qualname({}, dev=tmp_path) is None  # vLLM-Omni's own platform wins
    assert detect.cpu_platform_qualname({"OMNI_EXT_CPU_PLATFORM": "1"}, dev=tmp_path) == detect.CPU_PLATFORM_QUALNAME


def test_active_on_a_host_without_accelerator(tmp_path: Path) -> None:
    assert detect.cpu_platform_qualname({}, dev=tmp_path) == detect.CPU_PLATFORM_QUALNAME
    assert detect.cpu_platform_qualname({"OMNI_EXT_CPU_PLATFORM": "0"}, dev=tmp_path) is None


@pytest.mark.parametrize(
    "world,cores,env,expected",
    [(1, 2, {}, 2), (2, 2, {}, 1), (4, 2, {}, 1), (2, 16, {}, 8),
     (2, 2, {"OMNI_EXT_USER_OMP_NUM_THREADS": "3", "OMP_NUM_THREADS": "1"}, 3),  # operator's value wins
     (2, 8, {"OMNI_EXT_USER_OMP_NUM_THREADS": "", "OMP_NUM_THREADS": "1"}, 4)],  # vLLM's export does not
)
def test_threads_per_worker(world: int, cores: int, env: dict[str, str], expected: int) -> None:
    assert threads.threads_per_worker(world, cores=cores, environ=env) == expected


def test_remember_user_omp_only_once() -> None:
    env = {"OMP_NUM_THREADS": "5"}
    threads.remember_user_omp(env)
    env["OMP_NUM_THREADS"] = "1"
    threads.remember_user_omp(env)
    assert env[threads.USER_OMP_ENV] == "5"


def test_memory_figures_are_real() -> None:
    rss = memory.rss_bytes()
    assert rss > 10 * 2**20
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB
    assert memory.peak_rss_bytes() >= rss
    del block
    if memory.reset_peak():
        assert memory.peak_rss_bytes() < rss + 64 * 2**20
    avail, total = memory.host_memory()
    assert 0 < avail <= total


def test_platform_class_and_attention_backend() -> None:
    from omni_ext.platform.attention import CpuSDPAImpl
    from omni_ext.platform.cpu import CpuOmniPlatform

    p = CpuOmniPlatform
    assert p.get_torch_device(3) == torch.device("cpu")
    assert p.dist_backend == "gloo" and not p.supports_torch_inductor()
    assert p.max_memory_reserved() > 0 and p.memory_allocated() > 0 and p.get_device_total_memory() > 0
    backend_path = p.get_diffusion_attn_backend_cls(None, 64)
    module, _, cls = backend_path.rpartition(".")
    backend = getattr(__import__(module, fromlist=[cls]), cls)
    impl = backend.get_impl_cls()(num_heads=2, head_size=8, softmax_scale=8**-0.5)
    assert isinstance(impl, CpuSDPAImpl)
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))  # [B, S, H, D] as vLLM-Omni passes them
    out = impl.forward(q, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-6)


_FAULTS = """
import resource, statistics, sys, threading, torch
from omni_ext.platform.memory import keep_freed_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap() and keep_freed_heap()
seen = []
def job():  # what a TunedExecutor job does in its own thread: tensors made and freed
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(5):
        xs = [torch.ones(n) for n in (1 << 16, 1 << 18, 1 << 20)]  # 256 KiB .. 4 MiB
        del xs
    seen.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
for _ in range(12):
    t = threading.Thread(target=job); t.start(); t.join()
print(statistics.median(seen[2:]))
"""


def test_keep_freed_heap_stops_thread_jobs_faulting_their_tensors_in_again() -> None:
    """The bug keep_freed_heap answers: a job thread's freed tensors go back to the kernel, so each
    job's tensors fault their pages in again (2026-12-07: the tiny Wan's text encoder took 48-63 ms
    per prompt in a fresh thread against 21-28 ms in the main thread). Page faults per job (the
    median of ten fresh threads), not time, tell it apart: about 2,000 against 0 here."""
    import subprocess
    import sys

    def faults(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True,
                             timeout=120)
        return float(out.stdout.split()[-1])

    plain, kept = faults("plain"), faults("keep")
    assert plain > 500 and kept * 10 < plain, (plain, kept)
