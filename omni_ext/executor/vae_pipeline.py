"""Wan VAE decode divided between the two CFG ranks as a two-stage layer pipeline.

The Wan decoder runs latent frame by latent frame with a causal feature cache, so frames cannot be
split between ranks, and its mid-block attention spans the whole frame, so tiles cannot be split
exactly either. Layers can: CFG rank 0 runs the first part of the decoder (``conv_in``, mid block,
the first up-block units) for frame *i* and sends the activation to CFG rank 1, which runs the rest
for frame *i* while rank 0 already works on frame *i + 1*. Every rank keeps the causal cache of its
own layers. Each layer sees exactly the inputs it sees in the one-device decode, so the output is
bitwise the same arithmetic; only the owner of the last stage (CFG rank 1) holds the video.

The split point balances the two stages' conv FLOPs, counted on a tiny dummy frame with forward
hooks (deterministic, so both ranks compute the same split without talking).

Under VAE tiling (``vae.use_tiling``, set by vLLM-Omni from ``vae_use_tiling``, which every shipped
Wan preset turns on) diffusers' ``AutoencoderKLWan.tiled_decode`` decodes overlapping spatial tiles,
each from a fresh causal cache, and only then blends neighbours. The tiles are independent, so the
pair shares them instead: each rank decodes its own tiles (the same ops on the same tile inputs as
the one-device loop), CFG rank 0 sends its tiles to rank 1, and rank 1 blends in diffusers' order.
Bitwise the one-device tiled decode again; the video ends on CFG rank 1 as above.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger("omni_ext.executor")

_HEADER_LEN = 8


def decoder_units(dec: nn.Module) -> list[tuple]:
    units: list[tuple] = [("conv_in",), ("mid",)]
    for i, block in enumerate(dec.up_blocks):
        resnets = getattr(block, "resnets", None)
        if type(block).__name__ == "WanUpBlock" and resnets is not None:
            units += [("res", i, j) for j in range(len(resnets))]
            if getattr(block, "upsamplers", None) is not None:
                units.append(("ups", i))
        else:
            units.append(("up", i))
    units.append(("head",))
    return units


def _cached_conv(conv: nn.Module, x: torch.Tensor, cache: list, idx: list[int]) -> torch.Tensor:
    from diffusers.models.autoencoders.autoencoder_kl_wan import CACHE_T

    i = idx[0]
    cache_x = x[:, :, -CACHE_T:, :, :].clone()
    if cache_x.shape[2] < 2 and cache[i] is not None:
        cache_x = torch.cat([cache[i][:, :, -1, :, :].unsqueeze(2).to(cache_x.device), cache_x], dim=2)
    x = conv(x, cache[i])
    cache[i] = cache_x
    idx[0] += 1
    return x


def run_units(dec: nn.Module, x: torch.Tensor, units: list[tuple], cache: list, first_chunk: bool, on_unit=None):
    """Run ``units`` of WanDecoder3d.forward on one latent frame (same ops, same order as diffusers)."""
    idx = [0]
    for n, u in enumerate(units):
        if on_unit is not None:
            on_unit(n)
        kind = u[0]
        if kind == "conv_in":
            x = _cached_conv(dec.conv_in, x, cache, idx)
        elif kind == "mid":
            x = dec.mid_block(x, feat_cache=cache, feat_idx=idx)
        elif kind == "res":
            x = dec.up_blocks[u[1]].resnets[u[2]](x, feat_cache=cache, feat_idx=idx)
        elif kind == "ups":
            x = dec.up_blocks[u[1]].upsamplers[0](x, feat_cache=cache, feat_idx=idx)
        elif kind == "up":
            x = dec.up_blocks[u[1]](x, feat_cache=cache, feat_idx=idx, first_chunk=first_chunk)
        elif kind == "head":
            x = dec.norm_out(x)
            x = dec.nonlinearity(x)
            x = _cached_conv(dec.conv_out, x, cache, idx)
        else:  # pragma: no cover
            raise ValueError(u)
    return x


def unit_costs(vae: nn.Module, units: list[tuple]) -> list[float]:
    """Conv multiply-accumulates per unit for one non-first latent frame (tiny dummy, hooks)."""
    dec = vae.decoder
    costs = [0.0] * len(units)
    current = [0]

    def hook(mod, inp, out):
        k = 1
        for s in mod.kernel_size:
            k *= s
        costs[current[0]] += float(out.numel()) * mod.in_channels * k / mod.groups

    handles = [m.register_forward_hook(hook) for m in dec.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d))]
    try:
        p = next(vae.parameters())
        z_dim = vae.config.z_dim
        x = torch.zeros(1, z_dim, 1, 4, 4, dtype=p.dtype, device=p.device)
        cache: list[Any] = [None] * _num_cache_slots(vae)
        with torch.no_grad():
            run_units(dec, x, units, cache, True)
            for i in range(len(costs)):
                costs[i] = 0.0
            run_units(dec, x, units, cache, False, on_unit=lambda n: current.__setitem__(0, n))
    finally:
        for h in handles:
            h.remove()
    return costs


def _num_cache_slots(vae: nn.Module) -> int:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())


def balanced_split(costs: list[float]) -> int:
    """k such that units[:k] and units[k:] have the most equal cost (1 <= k < len)."""
    total = sum(costs)
    best_k, best = 1, float("inf")
    acc = 0.0
    for k in range(1, len(costs)):
        acc += costs[k - 1]
        worst = max(acc, total - acc)
        if worst < best:
            best_k, best = k, worst
    return best_k


def split_for(vae: nn.Module) -> tuple[list[tuple], int]:
    plan = getattr(vae, "_omni_ext_split", None)
    if plan is None:
        units = decoder_units(vae.decoder)
        costs = unit_costs(vae, units)
        k = balanced_split(costs)
        total = sum(costs) or 1.0
        logger.info(
            "omni-ext: Wan VAE decode split between CFG ranks after unit %d of %d (%s): %.0f%% / %.0f%% of conv work",
            k, len(units), units[k - 1], 100 * sum(costs[:k]) / total, 100 * sum(costs[k:]) / total,
        )
        plan = (units, k)
        vae._omni_ext_split = plan
    return plan


def can_pipeline(vae: nn.Module, z: torch.Tensor) -> bool:
    """The stock decode paths this reproduces: the frame loop (layer pipeline) or diffusers' tiled
    decode (tile split); not the CUDA fast path, not sliced batches."""
    if z.dim() != 5:
        return False
    if getattr(vae, "use_slicing", False) and z.shape[0] > 1:
        return False
    if not takes_tiled_path(vae, z) and z.shape[2] < 2:
        return False
    try:
        from vllm_omni.diffusion.distributed.autoencoders.wan_vae_fastpath import is_installed  # type: ignore

        if is_installed(vae):
            return False
    except Exception:
        pass
    return hasattr(vae, "decoder") and hasattr(vae.decoder, "up_blocks")


def takes_tiled_path(vae: nn.Module, z: torch.Tensor) -> bool:
    """Whether ``AutoencoderKLWan._decode`` would call ``tiled_decode`` for ``z`` (its own test)."""
    if not getattr(vae, "use_tiling", False):
        return False
    r = vae.spatial_compression_ratio
    return z.shape[-1] > vae.tile_sample_min_width // r or z.shape[-2] > vae.tile_sample_min_height // r


# Wire dtypes: the header's first field is the index of the tensor's dtype here.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _send(t: torch.Tensor, dst: int, group) -> list:
    """Send ``t`` with a header (dtype, ndim, shape) so the receiver needs no assumption about it."""
    t = t.contiguous()
    if t.dtype not in _DTYPES or t.dim() > _HEADER_LEN - 2:
        raise ValueError(f"cannot send a {t.dtype} tensor of {t.dim()} dims between the CFG ranks")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0] = _DTYPES.index(t.dtype)
    header[1] = t.dim()
    header[2 : 2 + t.dim()] = torch.tensor(list(t.shape), dtype=torch.int64)
    return [dist.isend(header.to(t.device), dst=dst, group=group), dist.isend(t, dst=dst, group=group)]


def _recv(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    header = header.cpu()
    shape = [int(s) for s in header[2 : 2 + int(header[1])]]
    buf = torch.empty(shape, dtype=_DTYPES[int(header[0])], device=device)
    dist.recv(buf, src=src, group=group)
    return buf


# ---- tiled decode: the pair shares diffusers' spatial tiles ------------------------------------------
def tile_grid(vae: nn.Module, z: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Latent (top, left) of each tile, row by row: the loops of diffusers' ``tiled_decode``."""
    r = vae.spatial_compression_ratio
    stride_h, stride_w = vae.tile_sample_stride_height // r, vae.tile_sample_stride_width // r
    return [[(i, j) for j in range(0, z.shape[-1], stride_w)] for i in range(0, z.shape[-2], stride_h)]


def assign_tiles(workloads: list[int], ranks: int = 2) -> list[int]:
    """Owner rank of each tile: largest first to the least-loaded rank, ties to the lower rank (the
    last rank also blends). Deterministic, so both ranks agree without talking."""
    load = [0] * ranks
    owner = [0] * len(workloads)
    for t in sorted(range(len(workloads)), key=lambda t: (-workloads[t], t)):
        r = load.index(min(load))
        owner[t] = r
        load[r] += workloads[t]
    return owner


def decode_tile(vae: nn.Module, z: torch.Tensor, top: int, left: int) -> torch.Tensor:
    """One tile of diffusers' ``tiled_decode``: frame by frame from a fresh causal cache."""
    r = vae.spatial_compression_ratio
    h, w = vae.tile_sample_min_height // r, vae.tile_sample_min_width // r
    cache: list[Any] = [None] * _num_cache_slots(vae)
    frames = []
    for k in range(z.shape[2]):
        tile = vae.post_quant_conv(z[:, :, k : k + 1, top : top + h, left : left + w])
        frames.append(vae.decoder(tile, feat_cache=cache, feat_idx=[0], first_chunk=(k == 0)))
    return torch.cat(frames, dim=2)


def blend_tiles(vae: nn.Module, z: torch.Tensor, rows: list[list[torch.Tensor]]) -> torch.Tensor:
    """Diffusers' ``tiled_decode`` after its decode loop: blend, crop, unpatchify, clamp."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    r = vae.spatial_compression_ratio
    sample_h, sample_w = z.shape[-2] * r, z.shape[-1] * r
    stride_h, stride_w = vae.tile_sample_stride_height, vae.tile_sample_stride_width
    min_h, min_w = vae.tile_sample_min_height, vae.tile_sample_min_width
    p = vae.config.patch_size
    if p is not None:
        sample_h, sample_w, stride_h, stride_w = sample_h // p, sample_w // p, stride_h // p, stride_w // p
        min_h, min_w = min_h // p, min_w // p
    blend_h, blend_w = min_h - stride_h, min_w - stride_w
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = vae.blend_v(rows[i - 1][j], tile, blend_h)
            if j > 0:
                tile = vae.blend_h(row[j - 1], tile, blend_w)
            result_row.append(tile[:, :, :, :stride_h, :stride_w])
        result_rows.append(torch.cat(result_row, dim=-1))
    out = torch.cat(result_rows, dim=3)[:, :, :, :sample_h, :sample_w]
    if p is not None:
        out = unpatchify(out, patch_size=p)
    return torch.clamp(out, min=-1.0, max=1.0)


def tiled_split_decode(vae: nn.Module, z: torch.Tensor, cfg_rank: int, peer: int, pg) -> torch.Tensor | None:
    """The pair's share of diffusers' tiled decode; the blended video on CFG rank 1, None on rank 0.

    Rank 0 sends each tile as soon as it is decoded (non-blocking); rank 1 decodes its own tiles,
    then receives rank 0's in grid order and blends. Only rank 1 holds all tiles, as the one-device
    decode does."""
    grid = tile_grid(vae, z)
    r = vae.spatial_compression_ratio
    h, w = vae.tile_sample_min_height // r, vae.tile_sample_min_width // r
    flat = [ij for row in grid for ij in row]
    work = [(min(i + h, z.shape[-2]) - i) * (min(j + w, z.shape[-1]) - j) for i, j in flat]  # latent tile area
    owner = assign_tiles(work)
    key = (len(grid), len(grid[0]), tuple(owner))
    logged = vae.__dict__.setdefault("_omni_ext_tiles_logged", set())
    if key not in logged:
        logged.add(key)
        logger.info(
            "omni-ext: Wan VAE tiled decode split between CFG ranks: %d x %d tiles, rank 0 decodes %d, rank 1 %d and blends",
            len(grid), len(grid[0]), owner.count(0), owner.count(1),
        )
    if cfg_rank == 0:
        pending: list = []
        for t, (i, j) in enumerate(flat):
            if owner[t] == 0:
                pending += _send(decode_tile(vae, z, i, j), peer, pg)
        for w_ in pending:
            w_.wait()
        return None
    tiles = {t: decode_tile(vae, z, i, j) for t, (i, j) in enumerate(flat) if owner[t] == 1}
    tiles.update({t: _recv(peer, pg, z.device) for t in range(len(flat)) if owner[t] == 0})  # rank 0's, in order
    cols = len(grid[0])
    rows = [[tiles[n + c] for c in range(cols)] for n in range(0, len(flat), cols)]
    return blend_tiles(vae, z, rows)


def pipelined_decode(vae: nn.Module, z: torch.Tensor, cfg_rank: int) -> torch.Tensor | None:
    """Decode ``z`` across the CFG pair. Returns the video on CFG rank 1, None on CFG rank 0."""
    from vllm_omni.diffusion.distributed.parallel_state import get_cfg_group

    group = get_cfg_group()
    return split_decode(vae, z, cfg_rank, group.ranks[1 - cfg_rank], group.device_group)


def split_decode(vae: nn.Module, z: torch.Tensor, cfg_rank: int, peer: int, pg) -> torch.Tensor | None:
    """The tile split where diffusers would tile, else the layer pipeline; ``peer`` is the other
    CFG rank's global rank in process group ``pg``."""
    if takes_tiled_path(vae, z):
        return tiled_split_decode(vae, z, cfg_rank, peer, pg)
    return layer_pipelined_decode(vae, z, cfg_rank, peer, pg)


def layer_pipelined_decode(vae: nn.Module, z: torch.Tensor, cfg_rank: int, peer: int, pg) -> torch.Tensor | None:
    """The frame loop of ``AutoencoderKLWan._decode`` as the two-stage layer pipeline (module docstring)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    units, k = split_for(vae)
    dec = vae.decoder
    cache: list[Any] = [None] * _num_cache_slots(vae)
    frames = z.shape[2]
    if cfg_rank == 0:
        x = vae.post_quant_conv(z)
        pending: list = []
        for i in range(frames):
            y = run_units(dec, x[:, :, i : i + 1, :, :], units[:k], cache, i == 0)
            pending += _send(y, peer, pg)
        for work in pending:
            work.wait()
        return None
    chunks = []
    for i in range(frames):
        a = _recv(peer, pg, z.device)
        chunks.append(run_units(dec, a, units[k:], cache, i == 0))
    out = torch.cat(chunks, dim=2)
    if vae.config.patch_size is not None:
        out = unpatchify(out, patch_size=vae.config.patch_size)
    return torch.clamp(out, min=-1.0, max=1.0)
