"""Triton kernel: QJL attention logits from the packed sign bits (reference: :mod:`kvcomp.kernels.qjl_scores`).

One program per (batch x KV head, group of ``group_size`` keys, block of query rows). The query rows of
a KV head are its ``n_rep`` GQA query heads times the query tokens, so each key's bits are read once
for all of them. The group's outlier correction ``u = S[:, O_g] q_{O_g}`` (``n_out`` columns of ``S``) enters by
associativity, ``<u, sign> = <S[:, O_g], sign> . q_{O_g}``, so that every product over the sketch's rows has the
signs on one side. Per tile of ``BLOCK_M`` sketch rows the program

1. unpacks the keys' bits to +-1 (bfloat16, exact) and loads ``y = S q`` (precomputed, one GEMV per query) and
   the group's outlier columns of ``S`` (rows of ``S^T``, contiguous);
2. accumulates ``<y, sign(S k_in)>``, ``<S[:, O_g], sign(S k_in)>`` and, on the first ``m_o`` rows,
   ``<S[:m_o, O_g], sign(S_{:m_o} k_out)>`` on tensor cores, each float32 operand split in two bfloat16 parts
   (:func:`_signed_sums`: about float32 accuracy);

then it subtracts ``<S[:, O_g], sign> . q_{O_g}``, scales by ``sqrt(pi/2)/m * ||k_in||`` and
``sqrt(pi/2)/m_o * ||k_out||`` and stores float32 logits. (Until 2026-11-28 it built ``u`` per tile from
strided columns of ``S`` and multiplied in float32 FMAs: ``scripts/kernel_model.py`` predicts the old kernel
16.5 ms at 16 x 32K, this one 2.7 ms.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcomp.kernels import Launch, launch_device
from kvcomp.kernels.formats import SketchedKeys
from kvcomp.kernels.formats.sketch_triton import sign_bits
from kvcomp.kernels.formats.tiles_triton import bf16_parts, dot
from kvcomp.stages.jl_sketch import estimator_scale


@triton.jit
def _signed_sums(sign, x):
    """``sign [rows, BLOCK_M] @ x [BLOCK_M, n]`` on bfloat16 tensor cores at about float32 accuracy (``x`` in its two
    :func:`~kvcomp.kernels.formats.tiles_triton.bf16_parts`; products with ``+-1`` are exact), float32 accumulation."""
    hi, lo = bf16_parts(x)
    return dot(sign, hi) + dot(sign, lo)


@triton.jit(do_not_specialize=["T"])  # grows with the cache: no recompilation as decoding goes on
def _qjl_scores_kernel(
    q_ptr, y_ptr, s_t_ptr, signs_ptr, inlier_norm_ptr, outlier_signs_ptr, outlier_norm_ptr, channels_ptr, out_ptr,
    R, T, scale_in, scale_out,
    D: tl.constexpr, M: tl.constexpr, M_OUT: tl.constexpr, N_OUT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr,
):
    bh = tl.program_id(0)
    group = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    tokens = group * GROUP + tl.arange(0, BLOCK_G)
    token_ok = tl.arange(0, BLOCK_G) < GROUP
    keys = bh * T + tokens
    o = tl.arange(0, BLOCK_O)
    o_ok = o < N_OUT
    channel = tl.load(channels_ptr + (bh * (T // GROUP) + group) * N_OUT + o, mask=o_ok, other=0).to(tl.int32)

    inner = tl.zeros((BLOCK_G, BLOCK_R), dtype=tl.float32)  # <S q, sign(S k_in)>, tokens x query rows
    w_in = tl.zeros((BLOCK_G, BLOCK_O), dtype=tl.float32)  # <S[:, O_g], sign(S k_in)>, tokens x outlier channels
    w_out = tl.zeros((BLOCK_G, BLOCK_O), dtype=tl.float32)  # <S[:m_o, O_g], sign(S_{:m_o} k_out)>
    for m0 in tl.range(0, M, BLOCK_M):
        cols = m0 + tl.arange(0, BLOCK_M)
        col_ok = cols < M  # y and S are zero past the sketch's M rows: their signs count for nothing
        sign = sign_bits(signs_ptr, keys, M // 8, token_ok, BLOCK_M, m0)  # [BLOCK_G, BLOCK_M]
        y = tl.load(y_ptr + (bh * R + rows[None, :]) * M + cols[:, None], mask=col_ok[:, None] & row_ok[None, :],
                    other=0.0)  # (S q)^T [BLOCK_M, BLOCK_R]
        inner += _signed_sums(sign, y)
        if N_OUT > 0:  # the group's outlier columns of S (rows of S^T, contiguous), [BLOCK_M, BLOCK_O]
            columns = tl.load(s_t_ptr + channel[None, :] * M + cols[:, None], mask=col_ok[:, None] & o_ok[None, :],
                              other=0.0)
            w_in += _signed_sums(sign, columns)
            if m0 < M_OUT:
                out_sign = sign_bits(outlier_signs_ptr, keys, M_OUT // 8, token_ok, BLOCK_M, m0)
                w_out += _signed_sums(out_sign, tl.where((cols < M_OUT)[:, None], columns, 0.0))

    inlier_norm = tl.load(inlier_norm_ptr + keys, mask=token_ok, other=0.0).to(tl.float32)
    if N_OUT > 0:  # u_g = S[:, O_g] q_{O_g}: <u_g, sign> = <S[:, O_g], sign> . q_{O_g}
        q_out = tl.load(q_ptr + (bh * R + rows[None, :]) * D + channel[:, None], mask=o_ok[:, None] & row_ok[None, :],
                        other=0.0)  # [BLOCK_O, BLOCK_R]
        inner -= tl.dot(w_in, q_out, input_precision="ieee")
    scores = scale_in * inlier_norm[:, None] * inner
    if N_OUT > 0:
        outlier_norm = tl.load(outlier_norm_ptr + keys, mask=token_ok, other=0.0).to(tl.float32)
        scores += scale_out * outlier_norm[:, None] * tl.dot(w_out, q_out, input_precision="ieee")
    tl.store(out_ptr + (bh * R + rows[None, :]) * T + tokens[:, None], scores, mask=token_ok[:, None] & row_ok[None, :])


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
    s_t = keys.columns(q.device)[0]  # S^T [D, m]: a column of S is a contiguous row
    y = (q @ s_t).contiguous()
    out = torch.empty(b, h, r, t, device=q.device, dtype=torch.float32)
    if t == 0:
        return out, None
    signs, inlier_norm = keys.signs.contiguous(), keys.inlier_norm.contiguous()
    if n_out:
        outlier_signs, outlier_norm = keys.outlier_signs.contiguous(), keys.outlier_norm.contiguous()
        channels = keys.outlier_channels.contiguous()
    else:  # not read by the kernel (N_OUT = 0: its loads are masked); any valid pointers
        outlier_signs, outlier_norm, channels = signs, inlier_norm, signs
    block_r = _tile(r)
    grid = (b * h, t // group, triton.cdiv(r, block_r))
    args = dict(q_ptr=q, y_ptr=y, s_t_ptr=s_t, signs_ptr=signs, inlier_norm_ptr=inlier_norm,
                outlier_signs_ptr=outlier_signs, outlier_norm_ptr=outlier_norm, channels_ptr=channels, out_ptr=out,
                R=r, T=t, scale_in=estimator_scale(m), scale_out=estimator_scale(m_out) if n_out else 0.0,
                D=d, M=m, M_OUT=m_out, N_OUT=n_out, GROUP=group,
                BLOCK_R=block_r, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_M=_tile(m, hi=32),
                BLOCK_O=max(16, triton.next_power_of_2(n_out)), num_warps=2)
    return out, Launch(_qjl_scores_kernel, grid, args)
