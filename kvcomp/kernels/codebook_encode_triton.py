"""Triton kernel: nearest-centroid coding fused with bit packing (reference:
:meth:`kvcomp.stages.codebook.CodebookQuantizer.encode`, torch; dispatch:
:func:`kvcomp.kernels.codebook_encode.encode_codebook`).

One program per (batch x KV head, block of ``BLOCK_N`` code rows, codebook group). For each chunk column
of its group it gathers the chunk vectors ``[BLOCK_N, dim]`` straight from the normalised block, finds
the nearest centroid with ``||c||^2 - 2 x.c`` (Eq. 4-5 of the thesis; ``||x||^2`` is constant per chunk)
over tiles of ``BLOCK_K`` centroids, and ORs the index into the packed byte, which it stores as soon as
it is complete. Codes never exist unpacked in device memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcomp.kernels import launch_device
from kvcomp.kernels.formats import fused_encode_supported
from kvcomp.stages.codebook import ChunkLayout


@triton.jit(do_not_specialize=["T"])  # prompt and block lengths vary: no recompilation per length
def _encode_kernel(
    z_ptr, codebooks_ptr, out_ptr, H, T,
    D: tl.constexpr, CENTROIDS: tl.constexpr, CODE_BITS: tl.constexpr, TL: tl.constexpr, CL: tl.constexpr,
    GC: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    bh = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(2)
    h = bh % H
    DIM: tl.constexpr = TL * CL
    COLUMNS: tl.constexpr = GC // CL  # chunk columns of one codebook group
    ROW_BYTES: tl.constexpr = (D // CL) * CODE_BITS // 8
    n_ok = n < T // TL
    e = tl.arange(0, DIM_PAD)
    e_ok = e < DIM
    token = n[:, None] * TL + (e // CL)[None, :]
    codebook = codebooks_ptr + (h * (D // GC) + group) * CENTROIDS * DIM
    packed = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for j in tl.static_range(COLUMNS):
        channel = group * GC + j * CL + e % CL
        x = tl.load(z_ptr + (bh * T + token) * D + channel[None, :], mask=n_ok[:, None] & e_ok[None, :], other=0.0)
        best = tl.zeros((BLOCK_N,), dtype=tl.int32)
        best_distance = tl.full((BLOCK_N,), float("inf"), dtype=tl.float32)
        for k0 in range(0, CENTROIDS, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < CENTROIDS
            centroids = tl.load(codebook + k[:, None] * DIM + e[None, :], mask=k_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
            distance = tl.sum(centroids * centroids, 1)[None, :] - 2.0 * tl.dot(x, tl.trans(centroids), input_precision="ieee")
            distance = tl.where(k_ok[None, :], distance, float("inf"))
            local = tl.min(distance, 1)
            better = local < best_distance  # strict: ties keep the lower index, as torch's argmin
            best = tl.where(better, k0 + tl.argmin(distance, 1).to(tl.int32), best)
            best_distance = tl.where(better, local, best_distance)
        packed = packed | (best << ((j * CODE_BITS) % 8))
        if ((j + 1) * CODE_BITS) % 8 == 0:
            byte = (group * COLUMNS + j) * CODE_BITS // 8
            tl.store(out_ptr + (bh * (T // TL) + n) * ROW_BYTES + byte, packed.to(tl.uint8), mask=n_ok)
            packed = tl.zeros((BLOCK_N,), dtype=tl.int32)


def encode_codebook_triton(z: torch.Tensor, codebooks: torch.Tensor, layout: ChunkLayout, code_bits: int) -> torch.Tensor:
    """Normalised ``z [B, H, T, D]`` -> packed uint8 codes ``[B, H, T/time_len, bytes]``, bit-identical to
    the torch path except at exact distance ties."""
    b, h, t, d = z.shape
    if not fused_encode_supported(layout, code_bits):
        raise ValueError(f"fused encode: a group of {layout.group_channels // layout.channel_len} {code_bits}-bit codes is not whole bytes")
    rows = t // layout.time_len
    out = torch.empty(b, h, rows, (d // layout.channel_len) * code_bits // 8, dtype=torch.uint8, device=z.device)
    if rows == 0:
        return out
    centroids = codebooks.shape[2]
    block_n = 64
    grid = (b * h, triton.cdiv(rows, block_n), d // layout.group_channels)
    with launch_device(z.device):
        _encode_kernel[grid](
            z.float().contiguous(), codebooks.contiguous(), out, h, t,
            D=d, CENTROIDS=centroids, CODE_BITS=code_bits, TL=layout.time_len, CL=layout.channel_len, GC=layout.group_channels,
            DIM_PAD=max(16, triton.next_power_of_2(layout.dim)), BLOCK_N=block_n,
            BLOCK_K=min(64, max(16, triton.next_power_of_2(centroids))),
        )
    return out
