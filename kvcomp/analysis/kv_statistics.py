"""Statistics of K/V activations for the TemporalKV information-theoretic study (spec §3).

Pure functions of tensors (torch only). Activations are laid out as the calibration collector writes
them, ``[samples, kv_heads, tokens, channels]``, or ``[samples, tokens, channels]`` for one head:
statistics are estimated per head and channel (or channel group), pooling samples and tokens.

* :func:`joint_entropy_per_float`: the "binning trick" (Kraskov et al. 2004) of the thesis' Figs. 13/14:
  per-channel z-score, uniform bins of width ``bin_width`` on ``[-clip, clip]``, plug-in joint entropy of
  the ``s``-dimensional integer vectors of temporal or channel chunks, with the Miller-Madow correction,
  divided by ``s``.
* :func:`gaussian_entropy_per_float`: the same quantity for a Gaussian with the measured correlations
  (a cross-check that does not saturate at ``log2(N)/s`` when ``s`` grows).
* :func:`effective_rank`: ``exp`` of the entropy of the normalised singular values (Roy & Vetterli 2007).
* :func:`lag_correlation` / :func:`adjacent_channel_correlation`: Pearson correlations along tokens
  (per channel, lags ``1..max_lag``) and between channels ``c`` and ``c+1`` (per token).
* :func:`fisher_by_position`: mean squared gradient per token position (the thesis' Fig. 18).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvcomp.stages.codebook import ChunkLayout

AXES = ("temporal", "channel")


class EntropyEstimate(NamedTuple):
    """``bits_per_float``: ``H/s`` in bits (a float, or a ``[heads, groups]`` tensor with ``reduction="none"``);
    ``samples``: the number of ``s``-vectors each distribution was estimated from."""

    bits_per_float: float | torch.Tensor
    samples: int


def _as_heads(x: torch.Tensor) -> torch.Tensor:
    """``[samples, tokens, C]`` or ``[samples, heads, tokens, C]`` -> ``[samples, heads, tokens, C]``."""
    if x.dim() == 3:
        return x[:, None]
    if x.dim() != 4:
        raise ValueError(f"expected [samples, (heads,) tokens, channels], got shape {tuple(x.shape)}")
    return x


def standardize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Per-channel z-score of ``[samples, (heads,) tokens, C]``: mean and std per (head, channel) over
    samples and tokens, in float64."""
    x = x.double()
    dims = (0, x.dim() - 2)
    mean = x.mean(dim=dims, keepdim=True)
    std = x.std(dim=dims, keepdim=True, correction=0)
    return (x - mean) / std.clamp_min(eps)


def quantize(z: torch.Tensor, bin_width: float = 0.25, clip: float = 4.0) -> torch.Tensor:
    """Bin indices ``0..nbins-1`` of uniform bins of width ``bin_width`` on ``[-clip, clip]`` (values
    outside are clipped into the end bins)."""
    nbins = num_bins(bin_width, clip)
    idx = torch.floor((z.double().clamp(-clip, clip) + clip) / bin_width).long()
    return idx.clamp_(0, nbins - 1)


def num_bins(bin_width: float, clip: float) -> int:
    return max(1, math.ceil(2 * clip / bin_width - 1e-9))


def chunk_vectors(x: torch.Tensor, chunk: int, axis: str) -> torch.Tensor:
    """Non-overlapping chunks as ``[heads, groups, N, chunk]``.

    ``temporal``: ``chunk`` consecutive tokens of one channel (groups = channels, ``N = samples *
    (tokens // chunk)``); ``channel``: ``chunk`` adjacent channels of one token (groups = ``C // chunk``
    channel groups, ``N = samples * tokens``). Trailing tokens/channels that do not fill a chunk are dropped.
    """
    if axis not in AXES:
        raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    x = _as_heads(x)
    _, _, T, C = x.shape
    if axis == "temporal":
        n = T // chunk
        if n == 0:
            raise ValueError(f"{T} tokens hold no temporal chunk of {chunk}")
        return ChunkLayout(time_len=chunk, channel_len=1, group_channels=1).to_chunks(x[:, :, : n * chunk])
    g = C // chunk
    if g == 0:
        raise ValueError(f"{C} channels hold no channel chunk of {chunk}")
    return ChunkLayout(time_len=1, channel_len=chunk, group_channels=chunk).to_chunks(x[..., : g * chunk])


def _even_subsample(n: int, k: int) -> torch.Tensor:
    return torch.linspace(0, n - 1, k).round().long()


def discrete_entropy_bits(codes: torch.Tensor, nbins: int, miller_madow: bool = True) -> torch.Tensor:
    """Plug-in (optionally Miller-Madow corrected) joint entropy in bits of integer vectors.

    ``codes``: ``[groups, N, s]`` with entries in ``0..nbins-1``; one distribution per group. Returns
    ``[groups]``. Miller-Madow adds ``(m - 1) / (2 N)`` nats, ``m`` the number of occupied cells.
    """
    G, N, s = codes.shape
    if N == 0:
        raise ValueError("no samples")
    cells = nbins**s
    if cells * G < 2**62:
        weights = torch.tensor([nbins**i for i in range(s)], dtype=torch.long)
        keys = (codes.long() * weights).sum(-1) + torch.arange(G)[:, None] * cells  # [G, N]
        uniq, counts = torch.unique(keys.reshape(-1), return_counts=True)
        group = torch.div(uniq, cells, rounding_mode="floor")
        p = counts.double() / N
        plugin = torch.zeros(G, dtype=torch.float64).index_add_(0, group, -p * torch.log(p))
        occupied = torch.zeros(G, dtype=torch.float64).index_add_(0, group, torch.ones_like(p))
    else:  # too many cells for one int64 key: count rows per group
        plugin = torch.empty(G, dtype=torch.float64)
        occupied = torch.empty(G, dtype=torch.float64)
        for g in range(G):
            _, counts = torch.unique(codes[g], dim=0, return_counts=True)
            p = counts.double() / N
            plugin[g], occupied[g] = -(p * torch.log(p)).sum(), len(counts)
    nats = plugin + (occupied - 1) / (2 * N) if miller_madow else plugin
    return nats / math.log(2)


def joint_entropy_per_float(
    x: torch.Tensor,
    chunk: int,
    axis: str = "temporal",
    bin_width: float = 0.25,
    clip: float = 4.0,
    *,
    miller_madow: bool = True,
    max_samples: int | None = None,
    standardized: bool = False,
    reduction: str = "mean",
) -> EntropyEstimate:
    """Joint entropy per float (bits) of ``chunk``-dimensional temporal or channel chunks.

    ``x``: ``[samples, (heads,) tokens, channels]``. Each channel is z-scored over samples and tokens
    (skip with ``standardized=True``), binned (``bin_width`` on ``[-clip, clip]``, the same bins for every
    ``chunk`` and ``axis``), cut into non-overlapping chunks (:func:`chunk_vectors`) and one distribution
    is estimated per (head, channel group). ``max_samples`` keeps that many evenly spaced chunks per
    distribution (compare axes at equal ``N``: temporal chunks are ``chunk`` times fewer than channel ones).
    Returns the mean of ``H / chunk`` over heads and groups (``reduction="none"``: the ``[heads, groups]``
    tensor) and the number of chunks per distribution.
    """
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    z = _as_heads(x) if standardized else standardize(_as_heads(x))
    codes = chunk_vectors(quantize(z, bin_width, clip), chunk, axis)  # [H, G, N, s]
    H, G, N, s = codes.shape
    if max_samples is not None and N > max_samples:
        codes = codes[:, :, _even_subsample(N, max_samples)]
        N = max_samples
    bits = discrete_entropy_bits(codes.reshape(H * G, N, s), num_bins(bin_width, clip), miller_madow)
    per_float = (bits / s).reshape(H, G)
    return EntropyEstimate(per_float.mean().item() if reduction == "mean" else per_float, N)


def gaussian_entropy_per_float(x: torch.Tensor, chunk: int, axis: str = "temporal", bin_width: float = 0.25,
                               *, reduction: str = "mean") -> float | torch.Tensor:
    """Entropy per float (bits, at resolution ``bin_width``) of a Gaussian with the chunks' correlations.

    For z-scored data, ``h/s = log2(sqrt(2 pi e) / bin_width) + log2(det R) / (2 s)``, with ``R`` the ``s x s``
    correlation matrix of the chunk vectors of each (head, group). It is the high-resolution entropy of the
    binned data if it were Gaussian and an upper bound on the differential part otherwise; unlike the
    plug-in estimate it does not saturate at ``log2(N) / s``, so it isolates what *linear* correlation
    buys at large ``s``.
    """
    v = chunk_vectors(standardize(_as_heads(x)), chunk, axis)  # [H, G, N, s]
    v = v - v.mean(dim=2, keepdim=True)
    cov = v.transpose(-1, -2) @ v / v.shape[2]
    d = cov.diagonal(dim1=-2, dim2=-1).clamp_min(1e-300).sqrt()
    corr = cov / (d[..., :, None] * d[..., None, :])
    logdet = torch.linalg.slogdet(corr).logabsdet / math.log(2)
    per_float = 0.5 * math.log2(2 * math.pi * math.e) - math.log2(bin_width) + logdet / (2 * chunk)
    return per_float.mean().item() if reduction == "mean" else per_float


def effective_rank(matrix: torch.Tensor) -> float:
    """``exp(-sum p_k ln p_k)`` with ``p_k = sigma_k / sum_j sigma_j`` (Roy & Vetterli 2007)."""
    sv = torch.linalg.svdvals(matrix.detach().double())
    total = sv.sum()
    if total <= 0:
        return 0.0
    p = sv / total
    p = p[p > 0]
    return math.exp(-(p * p.log()).sum().item())


def _pearson(a: torch.Tensor, b: torch.Tensor, dim: int, eps: float = 1e-300) -> torch.Tensor:
    a = a - a.mean(dim=dim, keepdim=True)
    b = b - b.mean(dim=dim, keepdim=True)
    num = (a * b).sum(dim=dim)
    den = (a.square().sum(dim=dim) * b.square().sum(dim=dim)).sqrt().clamp_min(eps)
    return num / den


def lag_correlation(x: torch.Tensor, max_lag: int) -> torch.Tensor:
    """``corr(x[t, c], x[t + tau, c])`` for ``tau = 1..max_lag``, per (head, channel).

    ``x``: ``[samples, (heads,) tokens, C]``; pairs are taken within each sample and pooled over samples.
    Returns ``[max_lag, heads, C]`` (``[max_lag, C]`` for 3-D input).
    """
    squeeze = x.dim() == 3
    x = _as_heads(x).double()
    S, H, T, C = x.shape
    if not 1 <= max_lag < T:
        raise ValueError(f"max_lag must be in 1..{T - 1}, got {max_lag}")
    out = []
    for tau in range(1, max_lag + 1):
        a = x[:, :, : T - tau].permute(1, 3, 0, 2).reshape(H, C, -1)
        b = x[:, :, tau:].permute(1, 3, 0, 2).reshape(H, C, -1)
        out.append(_pearson(a, b, dim=-1))
    r = torch.stack(out)
    return r[:, 0] if squeeze else r


def adjacent_channel_correlation(x: torch.Tensor, offset: int = 1) -> torch.Tensor:
    """``corr(x[t, c], x[t, c + offset])`` per (head, channel pair), pooled over samples and tokens.

    Returns ``[heads, C - offset]`` (``[C - offset]`` for 3-D input).
    """
    squeeze = x.dim() == 3
    x = _as_heads(x).double()
    S, H, T, C = x.shape
    if not 1 <= offset < C:
        raise ValueError(f"offset must be in 1..{C - 1}, got {offset}")
    flat = x.permute(1, 3, 0, 2).reshape(H, C, -1)
    r = _pearson(flat[:, :-offset], flat[:, offset:], dim=-1)
    return r[0] if squeeze else r


def fisher_by_position(grad2: torch.Tensor) -> torch.Tensor:
    """Mean squared gradient per token position: ``grad2 [samples, (heads,) tokens, C]`` -> ``[tokens]``."""
    g = _as_heads(grad2).double()
    return g.mean(dim=(0, 1, 3))
