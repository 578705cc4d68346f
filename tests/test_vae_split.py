"""The Wan VAE decode shared by a CFG pair under tiling (omni_ext/executor/vae_pipeline.py).

Unit tests run the real tiny Wan VAE on two gloo ranks (spawned processes) against diffusers'
one-device ``tiled_decode``. On real servers the split is shown by ``scripts/device_check.sh``
(tests/test_device_check.py): a TunedExecutor CFG-2 server with ``--vae-use-tiling`` gives the same
mp4 as vLLM-Omni's one-device executor with tiling, and logs the tiled split.

``python -m tests.test_vae_split`` measures the split against vLLM-Omni's own VAE patch parallel
(tile mode, and spatial_shard_width) on the same two ranks (the README figures).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omni_ext.executor import vae_pipeline as vp
from tests.helpers import process_context

# Small tiles so that a test-size latent tiles (diffusers' defaults: 256 / 192 sample pixels).
SMALL_TILES = {"tile_sample_min_height": 64, "tile_sample_min_width": 64,
               "tile_sample_stride_height": 48, "tile_sample_stride_width": 48}


def _vae(dtype: torch.dtype, tiles: dict | None = SMALL_TILES):
    from omni_ext.models.tiny import wan_vae

    vae = wan_vae().to(dtype).eval()
    vae.enable_tiling(**(tiles or {}))
    return vae


def _latent(shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(7)).to(dtype)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# One spawned gloo pair runs every case (a spawn costs seconds): (dtype, tiling) -> rank 1's video.
# 14 x 14 latent with 8 x 8 tiles at stride 6: a 3 x 3 grid, the last row and column cropped to 2;
# 2 latent frames. Without tiling the same latent runs the layer pipeline (diffusers' frame loop).
SHAPE = (1, 16, 2, 14, 14)
CASES = {"tiled-fp32": ("float32", True), "tiled-bf16": ("bfloat16", True), "frame-loop-bf16": ("bfloat16", False)}
SENT = [torch.arange(120, dtype=torch.bfloat16).view(2, 3, 1, 4, 5), torch.ones(7, dtype=torch.float16)]


def _pair_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for case, (dtype_name, tiling) in CASES.items():
            dtype = getattr(torch, dtype_name)
            vae, z = _vae(dtype), _latent(SHAPE, dtype)
            vae.use_tiling = tiling
            with torch.no_grad():
                out = vp.split_decode(vae, z, rank, 1 - rank, dist.group.WORLD)
            if rank == 0:
                assert out is None
            else:
                torch.save(out, Path(out_dir) / f"{case}.pt")
        if rank == 0:
            for w in [w for t in SENT for w in vp._send(t, 1, dist.group.WORLD)]:
                w.wait()
        else:
            torch.save([vp._recv(0, dist.group.WORLD, torch.device("cpu")) for _ in SENT], Path(out_dir) / "sent.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pair_outputs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vae-pair")
    process_context()  # the fork server's preload (torch, vLLM-Omni, omni-ext's executor), set before it starts
    mp.start_processes(_pair_worker, args=(_free_port(), str(out)), nprocs=2, start_method="forkserver")
    return out


@pytest.mark.spawns
@pytest.mark.parametrize("case", list(CASES))
def test_split_decode_is_byte_identical_to_one_device_decode(case, pair_outputs) -> None:
    dtype_name, tiling = CASES[case]
    dtype = getattr(torch, dtype_name)
    vae, z = _vae(dtype), _latent(SHAPE, dtype)
    vae.use_tiling = tiling
    assert vp.takes_tiled_path(vae, z) == tiling and vp.can_pipeline(vae, z)
    if tiling:
        assert [len(r) for r in vp.tile_grid(vae, z)] == [3, 3, 3]
    with torch.no_grad():
        ref = vae.decode(z).sample  # diffusers' own path: _decode -> tiled_decode or the frame loop
    got = torch.load(pair_outputs / f"{case}.pt")
    assert got.dtype == ref.dtype == dtype  # bf16 crossed the pipe as bf16: the header carried it
    assert got.shape == ref.shape == (1, 3, 5, 112, 112)
    assert got.view(torch.uint8).numpy().tobytes() == ref.view(torch.uint8).numpy().tobytes()


@pytest.mark.spawns
def test_send_recv_header_carries_dtype_and_shape(pair_outputs) -> None:
    got = torch.load(pair_outputs / "sent.pt")
    assert [(g.dtype, g.shape) for g in got] == [(t.dtype, t.shape) for t in SENT]
    assert all(torch.equal(g, t) for g, t in zip(got, SENT))


def test_split_follows_diffusers_choice_of_tiled_or_frame_loop() -> None:
    vae = _vae(torch.float32)
    small = torch.zeros(1, 16, 3, 8, 8)  # not larger than one 8 x 8 latent tile: diffusers does not tile
    assert not vp.takes_tiled_path(vae, small) and vp.can_pipeline(vae, small)
    one_frame = torch.zeros(1, 16, 1, 20, 14)
    assert vp.takes_tiled_path(vae, one_frame) and vp.can_pipeline(vae, one_frame)  # tiles split even at 1 frame
    vae.use_tiling = False
    assert not vp.takes_tiled_path(vae, one_frame) and not vp.can_pipeline(vae, one_frame)
    default = _vae(torch.float32, tiles=None)  # 256 / 192 sample pixels: a 288-pixel-wide video tiles
    assert vp.takes_tiled_path(default, torch.zeros(1, 16, 3, 8, 36))
    assert [len(r) for r in vp.tile_grid(default, torch.zeros(1, 16, 3, 32, 40))] == [2, 2]


def test_assign_tiles_balances_work_and_leaves_ties_to_rank_0() -> None:
    assert vp.assign_tiles([1024, 512, 256, 128]) == [0, 1, 1, 1]
    assert vp.assign_tiles([4, 4]) == [0, 1]
    assert vp.assign_tiles([5]) == [0]  # one tile: rank 0 decodes, rank 1 only blends (receives it)


# ---- measurement: the split vs vLLM-Omni's VAE patch parallel ------------------------------------------
def _bench_worker(rank: int, port: int, shape: tuple, reps: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from vllm_omni.diffusion.distributed.autoencoders import wan_spatial_shard
        from vllm_omni.diffusion.distributed.autoencoders.autoencoder_kl_wan import DistributedAutoencoderKLWan
        from vllm_omni.diffusion.distributed.autoencoders.distributed_vae_executor import DistributedVaeExecutor

        base = _vae(torch.float32, tiles=None)
        omni = DistributedAutoencoderKLWan.from_config(base.config).eval()
        omni.load_state_dict(base.state_dict())
        omni.enable_tiling()
        ex = DistributedVaeExecutor.__new__(DistributedVaeExecutor)  # its __init__ reads vLLM-Omni's world group
        ex.group, ex.world_size, ex.rank, ex.parallel_size, ex.parallel_mode = dist.group.WORLD, 2, rank, 2, "tile"
        omni.distributed_executor = ex
        z = _latent(shape, torch.float32)
        runs = {
            "one device (diffusers tiled)": lambda: base.decode(z).sample if rank == 1 else None,
            "omni-ext split": lambda: vp.split_decode(base, z, rank, 1 - rank, dist.group.WORLD),
            "vLLM-Omni tile": lambda: omni.tiled_decode(z, return_dict=False)[0],
            "vLLM-Omni spatial_shard_width": lambda: wan_spatial_shard.spatial_shard_decode(
                omni, z, group=dist.group.WORLD, return_dict=False, split_dim="width")[0],
            "one device UNtiled": lambda: untiled.decode(z).sample if rank == 1 else None,
            "omni-ext layer pipeline (UNtiled)": lambda: vp.split_decode(untiled, z, rank, 1 - rank, dist.group.WORLD),
        }
        untiled = _vae(torch.float32, tiles=None)
        untiled.use_tiling = False
        lines, outs = [], {}
        with torch.no_grad():
            for name, fn in runs.items():
                times = []
                for _ in range(reps):
                    dist.barrier()
                    t = time.perf_counter()
                    out = fn()
                    dist.barrier()
                    times.append(time.perf_counter() - t)
                outs[name] = out
                lines.append(f"{name}: {min(times):.2f} s (best of {reps})")
        owner = {"omni-ext split": 1, "vLLM-Omni tile": 0, "vLLM-Omni spatial_shard_width": 0,
                 "one device (diffusers tiled)": 1, "one device UNtiled": 1, "omni-ext layer pipeline (UNtiled)": 1}
        if rank == 0:
            for n, name in enumerate(runs):
                if owner[name] == 0:
                    torch.save(outs[name], Path(out_dir) / f"r0-{n}.pt")
        dist.barrier()
        if rank == 1:
            ref = outs["one device (diffusers tiled)"]
            for n, name in enumerate(runs):
                got = outs[name] if owner[name] == 1 else torch.load(Path(out_dir) / f"r0-{n}.pt")
                diff = (got.float() - ref.float()).abs().max().item() if got.shape == ref.shape else float("nan")
                lines.append(f"{name}: max |diff| vs one-device tiled decode {diff:.3g}, identical {torch.equal(got, ref)}")
            got = torch.load(Path(out_dir) / f"r0-{list(runs).index('vLLM-Omni spatial_shard_width')}.pt")
            for name, out in [("vLLM-Omni spatial_shard_width", got),
                              ("omni-ext layer pipeline (UNtiled)", outs["omni-ext layer pipeline (UNtiled)"])]:
                diff = (out.float() - outs["one device UNtiled"].float()).abs().max().item()
                lines.append(f"{name}: max |diff| vs one-device UNtiled decode {diff:.3g}")
            Path(out_dir, "bench.txt").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import sys
    import tempfile

    w, h = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "448x448").split("x"))
    shape = (1, 16, 3, h // 8, w // 8)  # 9 frames
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_bench_worker, args=(_free_port(), shape, 3, d), nprocs=2, start_method="spawn")
        print(f"{w}x{h}, 9 frames, tiny Wan VAE fp32, diffusers' default tiles, 2 gloo ranks x 1 thread")
        print(Path(d, "bench.txt").read_text())
