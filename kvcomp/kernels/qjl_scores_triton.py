"""Triton kernel: QJL attention logits from the packed sign bits (reference: :mod:`kvcomp.kernels.qjl_scores`).

One program per (batch x KV head, group of ``group_size`` keys, block of query rows). The query rows of
a KV head are its ``n_rep`` GQA query heads times the query tokens, so each key's bits are read once
for all of them. Per tile of ``BLOCK_M`` sketch rows the program

1. loads ``y = S q`` (precomputed, one GEMV per query) and builds the group's outlier correction
   ``u = S[:, O_g] q_{O_g}`` from ``n_out`` columns of ``S``;
2. unpacks the keys' bits to +-1 and accumulates ``<y - u, sign(S k_in)>`` and, on the first ``m_o``
   rows, ``<u, sign(S k_out)>`` with two small matrix products (fp32);
3. scales by ``sqrt(pi/2)/m * ||k_in||`` and ``sqrt(pi/2)/m_o * ||k_out||`` and stores float32 logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcomp.kernels import Launch, launch_device
from kvcomp.kernels.formats import SketchedKeys
from kvcomp.stages.jl_sketch import estimator_scale


@triton.jit(do_not_specialize=["T"])  # grows with the cache: no recompilation as decoding goes on
def _qjl_scores_kernel(
    q_ptr, y_ptr, s_ptr, signs_ptr, inlier_norm_ptr, outlier_signs_ptr, outlier_norm_ptr, channels_ptr, out_ptr,
    R, T, scale_in, scale_out,
    D: tl.constexpr, M: tl.constexpr, M_OUT: tl.constexpr, N_OUT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
):
    bh = tl.program_id(0)
    group = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    tokens = group * GROUP + tl.arange(0, BLOCK_G)
    token_ok = tl.arange(0, BLOCK_G) < GROUP
    num_groups = T // GROUP

    acc_in = tl.zeros((BLOCK_R, BLOCK_G), dtype=tl.float32)
    acc_out = tl.zeros((BLOCK_R, BLOCK_G), dtype=tl.float32)
    for m0 in tl.static_range(0, M, BLOCK_M):
        cols = m0 + tl.arange(0, BLOCK_M)
        col_ok = cols < M
        y = tl.load(y_ptr + (bh * R + rows[:, None]) * M + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        byte = tl.load(
            signs_ptr + (bh * T + tokens[:, None]) * (M // 8) + cols[None, :] // 8,
            mask=token_ok[:, None] & col_ok[None, :], other=0,
        ).to(tl.int32)
        sign = ((byte >> (cols[None, :] % 8)) & 1).to(tl.float32) * 2.0 - 1.0  # [BLOCK_G, BLOCK_M]
        if N_OUT > 0:
            u = tl.zeros((BLOCK_R, BLOCK_M), dtype=tl.float32)
            for o in tl.static_range(N_OUT):
                channel = tl.load(channels_ptr + (bh * num_groups + group) * N_OUT + o).to(tl.int32)
                q_c = tl.load(q_ptr + (bh * R + rows) * D + channel, mask=row_ok, other=0.0)
                s_c = tl.load(s_ptr + cols * D + channel, mask=col_ok, other=0.0)
                u += q_c[:, None] * s_c[None, :]
            y = y - u
            if m0 < M_OUT:
                out_ok = cols < M_OUT
                out_byte = tl.load(
                    outlier_signs_ptr + (bh * T + tokens[:, None]) * (M_OUT // 8) + cols[None, :] // 8,
                    mask=token_ok[:, None] & out_ok[None, :], other=0,
                ).to(tl.int32)
                out_sign = ((out_byte >> (cols[None, :] % 8)) & 1).to(tl.float32) * 2.0 - 1.0
                u = tl.where(out_ok[None, :], u, 0.0)
                acc_out += tl.dot(u, tl.trans(out_sign), input_precision="ieee")
        acc_in += tl.dot(y, tl.trans(sign), input_precision="ieee")

    inlier_norm = tl.load(inlier_norm_ptr + bh * T + tokens, mask=token_ok, other=0.0).to(tl.float32)
    scores = scale_in * inlier_norm[None, :] * acc_in
    if N_OUT > 0:
        outlier_norm = tl.load(outlier_norm_ptr + bh * T + tokens, mask=token_ok, other=0.0).to(tl.float32)
        scores += scale_out * outlier_norm[None, :] * acc_out
    tl.store(out_ptr + (bh * R + rows[:, None]) * T + tokens[None, :], scores, mask=row_ok[:, None] & token_ok[None, :])


def _tile(n: int, lo: int = 16, hi: int = 64) -> int:
    """A power-of-two tile of at least ``lo`` (``tl.dot``'s minimum) and at most ``hi`` covering ``n``."""
    return min(hi, max(lo, triton.next_power_of_2(n)))


def qjl_scores_triton(query: torch.Tensor, keys: SketchedKeys) -> torch.Tensor:
    """Same contract as :func:`~kvcomp.kernels.qjl_scores.qjl_scores_reference`: ``[B, H, R, D]`` queries
    -> float32 ``[B, H, R, T]`` logits."""
    out, launch = qjl_score_launch(query, keys)
    if launch is not None:
        with launch_device(query.device):
            launch()
    return out


def qjl_score_launch(query: torch.Tensor, keys: SketchedKeys) -> tuple[torch.Tensor, Launch | None]:
    """The output buffer and the launch of :func:`qjl_scores_triton` (``None`` without keys), not run."""
    b, h, r, d = query.shape
    t = keys.signs.shape[2]
    m, m_out, n_out, group = keys.sketch_dim, keys.outlier_sketch_dim, keys.num_outliers, keys.group_size
    if t % group:
        raise ValueError(f"qjl kernel: {t} keys is not a multiple of group_size={group}")
    q = query.float().contiguous()
    projection = keys.projection.to(device=q.device, dtype=torch.float32).contiguous()
    y = (q @ projection.T).contiguous()
    out = torch.empty(b, h, r, t, device=q.device, dtype=torch.float32)
    if t == 0:
        return out, None
    signs, inlier_norm = keys.signs.contiguous(), keys.inlier_norm.contiguous()
    if n_out:
        outlier_signs, outlier_norm = keys.outlier_signs.contiguous(), keys.outlier_norm.contiguous()
        channels = keys.outlier_channels.contiguous()
    else:  # unused by the kernel (N_OUT = 0); any valid pointers
        outlier_signs, outlier_norm, channels = signs, inlier_norm, signs
    block_r = _tile(r)
    grid = (b * h, t // group, triton.cdiv(r, block_r))
    args = dict(q_ptr=q, y_ptr=y, s_ptr=projection, signs_ptr=signs, inlier_norm_ptr=inlier_norm,
                outlier_signs_ptr=outlier_signs, outlier_norm_ptr=outlier_norm, channels_ptr=channels, out_ptr=out,
                R=r, T=t, scale_in=estimator_scale(m), scale_out=estimator_scale(m_out) if n_out else 0.0,
                D=d, M=m, M_OUT=m_out, N_OUT=n_out, GROUP=group,
                BLOCK_R=block_r, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_M=_tile(m))
    return out, Launch(_qjl_scores_kernel, grid, args)
