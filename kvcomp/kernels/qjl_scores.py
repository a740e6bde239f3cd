"""Attention logits straight from QJL's packed key sketches (the decode-step score path).

For queries ``q`` and a group ``g`` of ``group_size`` keys sharing the outlier channels ``O_g`` (spec §2.4):

    <q, k>^ = sqrt(pi/2)/m   * ||k_in||  * <S q_in, sign(S k_in)>
            + sqrt(pi/2)/m_o * ||k_out|| * <S_{:m_o} q_out, sign(S_{:m_o} k_out)>

with ``q_in``/``q_out`` the query masked to the inlier/outlier channels of the key's group. The inlier
query sketch is computed as ``S q - u_g`` with ``u_g = S[:, O_g] q_{O_g}``, so ``S q`` is one GEMV per
query and ``u_g`` is ``n_out`` columns of ``S`` per group. :func:`qjl_scores_reference` is the torch
reference; :func:`qjl_scores` dispatches to the Triton kernel of :mod:`kvcomp.kernels.qjl_scores_triton`.
"""

from __future__ import annotations


import torch

from kvcomp.kernels.formats import SketchedKeys
from kvcomp.stages.jl_sketch import estimator_scale, unpack_signs


def qjl_scores_reference(query: torch.Tensor, keys: SketchedKeys, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Estimated ``<q, k>`` for queries ``[B, H, R, D]`` (the ``R`` queries of each KV head) and the
    sketched keys: ``[B, H, R, T]`` computed in ``dtype`` (float32; float64 for the GPU checks)."""
    q = query.to(dtype)
    b, h, r, d = q.shape
    m, projection = keys.sketch_dim, keys.projection.to(q.device, dtype)
    y = q @ projection.T  # [B, H, R, m]
    signs = unpack_signs(keys.signs, m).to(dtype)  # [B, H, T, m]
    inlier_norm = keys.inlier_norm.to(dtype)[:, :, None, :]
    if keys.num_outliers == 0:
        return estimator_scale(m) * inlier_norm * (y @ signs.transpose(-1, -2))
    t, g, n = signs.shape[2], keys.group_size, keys.num_outliers
    groups = t // g
    channels = keys.outlier_channels.long()  # [B, H, groups, n]
    q_out = q[:, :, :, None, :].expand(b, h, r, groups, d).gather(-1, channels[:, :, None].expand(b, h, r, groups, n))
    columns = projection.T[channels]  # [B, H, groups, n, m]: S[:, O_g]^T
    u = torch.einsum("bhrgn,bhgnm->bhrgm", q_out, columns)  # S[:, O_g] q_{O_g}
    inner_in = torch.einsum("bhrgm,bhgtm->bhrgt", y[:, :, :, None, :] - u, signs.view(b, h, groups, g, m))
    m_o = keys.outlier_sketch_dim
    outlier_signs = unpack_signs(keys.outlier_signs, m_o).to(dtype).view(b, h, groups, g, m_o)
    inner_out = torch.einsum("bhrgm,bhgtm->bhrgt", u[..., :m_o], outlier_signs)
    outlier_norm = keys.outlier_norm.to(dtype)[:, :, None, :]
    return (
        estimator_scale(m) * inlier_norm * inner_in.reshape(b, h, r, t)
        + estimator_scale(m_o) * outlier_norm * inner_out.reshape(b, h, r, t)
    )


def qjl_scores(query: torch.Tensor, keys: SketchedKeys, backend: str = "torch") -> torch.Tensor:
    """:func:`qjl_scores_reference` (``backend="torch"``) or the Triton kernel (``"triton"``)."""
    if backend == "triton":
        from kvcomp.kernels.qjl_scores_triton import qjl_scores_triton

        return qjl_scores_triton(query, keys)
    return qjl_scores_reference(query, keys)
