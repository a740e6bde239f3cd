"""Triton kernel: QJL attention logits from the packed sign bits (reference: :mod:`kvcomp.kernels.qjl_scores`).

One program per (batch x KV head, group of ``group_size`` keys, block of query rows). The query rows of
a KV head are its ``n_rep`` GQA query heads times the query tokens, so each key's bits are read once
for all of them. A program computes what the fused decode kernel computes for one tile of sketched keys
(:func:`~kvcomp.kernels.formats.sketch_triton.dot_scores`, reading the same arguments,
:meth:`~kvcomp.kernels.formats.SketchReader.kernel_args`): the group's outlier correction
``u = S[:, O_g] q_{O_g}`` enters by associativity, ``<u, sign> = <S[:, O_g], sign> . q_{O_g}``, so that every
product over the sketch's rows has the signs on one side; the signs are exact bfloat16 operands against the two
bfloat16 parts of ``y = S q`` and of the group's columns of ``S`` (rows of ``S^T``) on tensor cores. (Building ``u``
per tile from strided columns of ``S`` and multiplying in float32 FMAs is slower: ``tools/kernel_model.py`` predicts
that form 16.5 ms at 16 x 32K.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcomp.kernels import Launch, launch_device
from kvcomp.kernels.formats import CallQuery, SketchedKeys, SketchReader
from kvcomp.kernels.formats.sketch_triton import advance, dot_scores


@triton.jit(do_not_specialize=["T"])  # grows with the cache: no recompilation as decoding goes on
def _qjl_scores_kernel(q_ptr, a, out_ptr, H, R, T, C: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_G: tl.constexpr):
    """One program per (batch x KV head, group of keys, block of query rows): the fused kernel's scores of one tile
    (:func:`~kvcomp.kernels.formats.sketch_triton.dot_scores`), stored as float32 logits."""
    GROUP: tl.constexpr = C.GROUP
    bh = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * GROUP
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    t = first + tl.arange(0, BLOCK_G)
    t_ok = tl.arange(0, BLOCK_G) < GROUP
    a = advance(a, C, bh // H, bh % H, D)
    s = dot_scores(q_ptr + bh * R * D, tl.program_id(2) * BLOCK_R, R, a, C, t, first, t_ok, D, BLOCK_R, BLOCK_G)
    tl.store(out_ptr + (bh * R + rows[:, None]) * T + t[None, :], s, mask=row_ok[:, None] & t_ok[None, :])


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
    group = keys.group_size
    if t % group:
        raise ValueError(f"qjl kernel: {t} keys is not a multiple of group_size={group}")
    q = query.float().contiguous()
    out = torch.empty(b, h, r, t, device=q.device, dtype=torch.float32)
    if t == 0:
        return out, None
    block_r = _tile(r)
    sketch, constants = SketchReader(t, d, keys).kernel_args(CallQuery(q))
    constants = constants.stacking(min(r, block_r))  # a program's query rows
    grid = (b * h, t // group, triton.cdiv(r, block_r))
    args = dict(q_ptr=q, a=sketch, out_ptr=out, H=h, R=r, T=t, C=constants, D=d, BLOCK_R=block_r,
                BLOCK_G=max(16, triton.next_power_of_2(group)))
    return out, Launch(_qjl_scores_kernel, grid, args)
