"""The quantized Johnson-Lindenstrauss sketch of QJL (Zandieh et al. 2024, Def. 3.1).

A projection ``S [m, d]`` codes a key as ``H_S(k) = sign(S k)`` (Eq. 3), ``m`` bits, plus ``||k||``. A
query is projected but not quantized, which gives the asymmetric estimator (Eq. 4)

    Prod(q, k) = sqrt(pi/2) / m * ||k|| * <S q, sign(S k)>,

unbiased for ``<q, k>`` when ``S`` is i.i.d. N(0, 1) (Lemma 3.2), with variance
``((pi/2) ||q||^2 ||k||^2 - <q, k>^2) / m`` (spec §3). Since it is linear in ``q``, it equals
``<q, k_hat>`` with ``k_hat = sqrt(pi/2) / m * ||k|| * S^T sign(S k)``, an unbiased (if noisy)
reconstruction of ``k``: standard attention over ``k_hat`` computes exactly the QJL scores.

Sign convention and packing as the authors' code: bit 1 iff ``(S k)_j > 0``, LSB-first, so bit ``j`` of
byte ``b`` is sketch row ``8b + j``.
"""

from __future__ import annotations

import math

import torch

from kvcomp.stages.packing import pack_bits, unpack_bits

PROJECTIONS = ("orthogonal", "gaussian")
ROW_NORMS = ("sqrt_d", "chi")


def estimator_scale(m: int) -> float:
    """``sqrt(pi/2) / m``: ``E|N(0, s^2)| = s sqrt(2/pi)`` turns the sign sketch back into an inner product."""
    return math.sqrt(math.pi / 2) / m


def orthogonal_row_bias(d: int) -> float:
    """``E[Prod] / <q, k>`` when every row of ``S`` has norm exactly ``sqrt(d)`` (spec §2.3):
    ``beta_d = sqrt(pi/2) sqrt(d) Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2))`` (1.00196 for d = 128)."""
    log_ratio = math.lgamma(d / 2) - math.lgamma((d + 1) / 2)
    return math.sqrt(math.pi / 2) * math.sqrt(d) * math.exp(log_ratio) / math.sqrt(math.pi)


def jl_projection(m: int, d: int, projection: str = "orthogonal", row_norm: str = "sqrt_d", seed: int = 0) -> torch.Tensor:
    """The ``[m, d]`` float32 projection, drawn on the CPU from ``seed`` (same matrix on every device).

    ``gaussian``: i.i.d. N(0, 1). ``orthogonal`` (the paper's choice, all its experiments): a Gaussian
    ``G [d, m]`` orthogonalized by QR in blocks of ``d`` columns (``m > d`` rows cannot all be orthogonal),
    each row then rescaled to ``sqrt(d)`` (``row_norm: sqrt_d``, the authors' code; biased by
    :func:`orthogonal_row_bias`) or to an independent chi_d draw (``row_norm: chi``: rows exactly
    N(0, I) marginally, so the estimator is exactly unbiased). QR's sign convention does not matter:
    the estimator is invariant to flipping a row's sign.
    """
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(d, m, generator=generator, dtype=torch.float64)
    if projection == "gaussian":
        return gaussian.T.contiguous().float()
    blocks = [torch.linalg.qr(gaussian[:, start : start + d], mode="reduced")[0] for start in range(0, m, d)]
    rows = torch.cat(blocks, dim=1).T  # [m, d], unit rows, orthogonal within each block of d
    if row_norm == "chi":
        norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    else:
        norms = torch.full((m, 1), math.sqrt(d), dtype=torch.float64)
    return (rows * norms).contiguous().float()


def sign_sketch(x: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """Packed ``sign(S x)`` bits: ``x [..., d]`` -> uint8 ``[..., m / 8]`` (Eq. 3)."""
    return pack_bits((x.float() @ projection.mT > 0).to(torch.uint8), 1)


def unpack_signs(packed: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of the packing in :func:`sign_sketch`: float ``+-1`` of shape ``[..., m]``."""
    return unpack_bits(packed, 1, m).float() * 2 - 1


def group_outlier_channels(x: torch.Tensor, group_size: int, count: int) -> torch.Tensor:
    """The ``count`` channels of largest l2 norm over each group of ``group_size`` consecutive tokens
    (the authors' code): ``x [B, H, T, D]`` -> int64 ``[B, H, T / group_size, count]``."""
    b, h, t, d = x.shape
    norms = x.float().reshape(b, h, t // group_size, group_size, d).norm(dim=-2)
    return norms.topk(count, dim=-1).indices


def channel_mask(channels: torch.Tensor, head_dim: int, group_size: int) -> torch.Tensor:
    """Boolean ``[B, H, T, D]``: True on each token's group outlier channels (``channels [B, H, T/G, n]``)."""
    b, h, groups, _ = channels.shape
    mask = torch.zeros(b, h, groups, head_dim, dtype=torch.bool, device=channels.device)
    mask.scatter_(-1, channels.long(), True)
    return mask.repeat_interleave(group_size, dim=2)
