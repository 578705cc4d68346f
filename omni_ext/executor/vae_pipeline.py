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
    """The stock decode path this reproduces: not tiled, not the CUDA fast path, not sliced batches."""
    if z.dim() != 5 or z.shape[2] < 2:
        return False
    if getattr(vae, "use_slicing", False) and z.shape[0] > 1:
        return False
    if getattr(vae, "use_tiling", False):
        return False
    try:
        from vllm_omni.diffusion.distributed.autoencoders.wan_vae_fastpath import is_installed  # type: ignore

        if is_installed(vae):
            return False
    except Exception:
        pass
    return hasattr(vae, "decoder") and hasattr(vae.decoder, "up_blocks")


def _send(t: torch.Tensor, dst: int, group) -> list:
    t = t.contiguous()
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0] = t.dim()
    header[1 : 1 + t.dim()] = torch.tensor(list(t.shape), dtype=torch.int64)
    return [dist.isend(header.to(t.device), dst=dst, group=group), dist.isend(t, dst=dst, group=group)]


def _recv(src: int, group, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group)
    header = header.cpu()
    shape = [int(s) for s in header[1 : 1 + int(header[0])]]
    buf = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(buf, src=src, group=group)
    return buf


def pipelined_decode(vae: nn.Module, z: torch.Tensor, cfg_rank: int) -> torch.Tensor | None:
    """Decode ``z`` across the CFG pair. Returns the video on CFG rank 1, None on CFG rank 0."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify
    from vllm_omni.diffusion.distributed.parallel_state import get_cfg_group

    group = get_cfg_group()
    units, k = split_for(vae)
    dec = vae.decoder
    cache: list[Any] = [None] * _num_cache_slots(vae)
    frames = z.shape[2]
    pg = group.device_group
    if cfg_rank == 0:
        x = vae.post_quant_conv(z)
        pending: list = []
        for i in range(frames):
            y = run_units(dec, x[:, :, i : i + 1, :, :], units[:k], cache, i == 0)
            pending += _send(y, group.ranks[1], pg)
        for work in pending:
            work.wait()
        return None
    chunks = []
    for i in range(frames):
        a = _recv(group.ranks[0], pg, z.dtype, z.device)
        chunks.append(run_units(dec, a, units[k:], cache, i == 0))
    out = torch.cat(chunks, dim=2)
    if vae.config.patch_size is not None:
        out = unpatchify(out, patch_size=vae.config.patch_size)
    return torch.clamp(out, min=-1.0, max=1.0)
