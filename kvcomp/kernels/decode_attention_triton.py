"""Triton kernels: decode attention reading packed K/V payloads (reference: :mod:`kvcomp.kernels.decode_attention`).

Flash-decoding in two kernels:

1. ``_split_kernel``: one program per (batch x KV head, slice of tokens). It loads the ``n_rep`` query
   heads of its KV head once, then for each tile of at most ``BLOCK_T`` tokens decodes K and V *in registers*
   (dense load, packed-int dequantization, codebook gather + denormalisation, or a float8 / int8 load times its
   scale; keys of pre-RoPE codecs rotated by their position), and updates an online softmax (base-2 exponentials). It writes
   the slice's normalised partial output and its log-sum-exp.
2. ``_merge_kernel``: combines the partials of all slices per query head,
   ``out = sum_s 2^(lse_s - m) out_s / sum_s 2^(lse_s - m)``.

A decode step is therefore two launches per layer (a payload stored in a rotated basis or less an offset adds its
own split launches and small matmuls: :func:`launch_groups`; a key offset's score ``q . R_p c`` is added in the
payload's tiles from the token's position, a value offset to the payload's partial outputs; TurboQuant-prod's
residual sketch adds its score ``sqrt(pi/2)/d ||r|| <S q, sign(S r)>`` to each key's, and its values' sketch is
weighted in launches of their own over the same keys, whose partial outputs are taken back by ``S`` and added).

One launch of the split kernel reads every segment of a step: per stream, up to three full-precision
pieces (sinks, tail and, under ``exact_prefill``, the fresh token: separate tensors, each with its own
pointer, strides and token range) and one encoded payload, whose format is fixed at compile time. Each
tile lies within one piece of each stream (tiles are cut at piece boundaries and end at multiples of
``BLOCK_T`` from the key payload's first token), and a scalar branch per tile and stream picks the
piece's decoder; a cache with more payloads per stream gets one launch per run of segments that fits
(:func:`~kvcomp.kernels.decode_plan.plan_decode`: planned once per step, run per layer, in a workspace kept across
steps). Everything that changes with the cache length (segment bounds, lengths, slot counts) is a
``do_not_specialize`` argument: a growing cache never recompiles a kernel. Strides are specialised: they stay
multiples of 16 as buffers grow (multiples of head_dim), which lets the compiler prove aligned vector loads of the
full-precision pieces. Every tensor is advanced to the program's sequence and head once, in
int64, so no offset overflows at a large batch x context. The step's attention mask is read per token
(one byte per cached token and sequence), so any mask runs in the kernel and nothing about it is checked
on the host.

Query heads per KV head (GQA's ``R``) are few (4 on Llama-3-8B, 8 on 70B), below an MMA tile; scores and
``P V`` are still ``tl.dot`` products over the query rows padded to 16 (TF32 for float32 operands, Triton's
default), with 4 warps and 32-token tiles, 128 for payloads read without a per-group table (:func:`default_tile`).
Measured on an H200 and an H100 (``scripts/sweep_decode_kernel.py``), that is the fastest configuration tried for
codebook payloads and, at batch 1, for packed ints; KIVI-2 at batch 16 x 32K ran faster with one register-path
warp (2.14 ms against 3.12 on the H200) but slower at batch 1. QJL's sketched keys are faster on the register
path: one query row at a time, each a ``[BLOCK_T, C]`` product reduced in registers (:func:`_row_scores`), also 4
warps and 32-token tiles, with up to 255 registers per thread. Channels are processed as two halves ``[0, D/2)`` and
``[D/2, D)``, which is what RoPE pairs: ``k_lo' = k_lo cos - k_hi sin``, ``k_hi' = k_hi cos + k_lo sin``.

Packed ints are read in their stored layout: each byte of a tile once, its ``8 / bits`` fields scored
against the matching query sub-vectors (:func:`_packed_scores`) or, on the register path, weighted into a
field-major accumulator (:func:`_packed_values`); ``tl.dot`` launches unpack values per tile. Codes of
3, 5, 6 or 7 bits, which straddle bytes, are unpacked per tile from the two bytes each may span (:func:`_codes`).

Each launch shares the tiles of its token range out evenly over its slices (+-1 tile), and the slice count fills
whole waves of the GPU's multiprocessors where the range is long enough
(:func:`~kvcomp.kernels.decode_plan._splits`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvcomp.kernels import Launch, launch_device
from kvcomp.kernels.decode_plan import MAX_DENSE, DecodeStep
from kvcomp.kernels.payloads import (
    DENSE,
    OffsetReader,
    PayloadReader,
    ResidualSketchReader,
    RotaryPositions,
    RotatedReader,
    Segment,
    SignReader,
    SketchReader,
    in_place,
    segment_length,
)
from kvcomp.stages.jl_sketch import estimator_scale
ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
LOG2E = 1.4426950408889634
# Launch defaults, measured on an H200 and an H100 (BENCHMARKS.md, "Launch configurations of the fused decode
# kernel", scripts/sweep_decode_kernel.py): 4 warps per split program; ``tl.dot`` for scores and P V except over
# QJL's sketched keys, which are fastest on the register path; 32-token tiles, or 128 where every payload is read
# without a per-group table (:func:`default_tile`). The former defaults (16 warps, 16-token tiles, register path)
# were 3-10x slower: their per-tile reductions crossed 16 warps.
WARPS = 4
TILE = 32
WIDE_TILE = 128
TINY = tl.constexpr(torch.finfo(torch.float32).tiny)  # the least norm a unit-norm rescaling divides by (as in torch)
OWN_LAUNCHES = (RotatedReader, OffsetReader, ResidualSketchReader)  # payloads read in launches of their own
SKETCH_STRIDES = ("sk_out_s_b", "sk_out_s_h", "sk_onorm_s_b", "sk_onorm_s_h", "sk_ch_s_b", "sk_ch_s_h")


@triton.jit
def _bases(
    b, h, data, scale, zero, codebooks, ch_scale, ch_center, tok_scale, tok_center,
    data_s_b, data_s_h, param_s_b, param_s_h, tok_s_b, tok_s_h,
    D: tl.constexpr, FMT: tl.constexpr, CENTROIDS: tl.constexpr, TL: tl.constexpr, CL: tl.constexpr, GC: tl.constexpr,
):
    """One encoded stream's tensors advanced to sequence ``b`` / KV head ``h`` (int64, so that no offset
    overflows at a large batch x context) by their own sequence and head strides: a payload store's view,
    narrowed along tokens from a buffer with spare capacity, is read in place. Within a sequence and head
    the helpers below index tokens as stored (rows contiguous). ``scale`` / ``zero``: packed ints' parameters,
    or QJL's key norms (``data``: its sign bits); ``tok_*``: per-token normalisation ``[B, T]`` (head stride 0) or
    ``[B, H, T]`` (TurboQuant / EDEN norms); ``tok_scale``: packed ints' multiplier (KVarN)."""
    if FMT != 0:
        data += b * data_s_b + h * data_s_h
        scale += b * param_s_b + h * param_s_h
        zero += b * param_s_b + h * param_s_h
        tok_scale += b * tok_s_b + h * tok_s_h
    if FMT == 2:
        codebooks += h * (D // GC) * CENTROIDS * (TL * CL)
        ch_scale += h * D
        ch_center += h * D
        tok_center += b * tok_s_b + h * tok_s_h
    return data, scale, zero, codebooks, ch_scale, ch_center, tok_scale, tok_center


@triton.jit
def _codes(data, row, index, ok, BITS: tl.constexpr, ROW_BYTES: tl.constexpr):
    """Code ``index`` of rows starting at byte ``row`` of a little-endian bit stream of ``BITS``-bit codes
    (:func:`~kvcomp.stages.packing.pack_bits`): one byte where codes fill bytes (1, 2, 4, 8 bits), else the two
    bytes a code may straddle (3, 5, 6, 7 bits; the second only where the row has one)."""
    if 8 % BITS == 0:  # (index // PER_BYTE, not index * BITS // 8: the compiler keeps fewer registers)
        PER_BYTE: tl.constexpr = 8 // BITS
        byte = tl.load(data + row + index // PER_BYTE, mask=ok, other=0).to(tl.int32)
        shift = (index % PER_BYTE) * BITS
    else:
        first = index * BITS // 8
        byte = tl.load(data + row + first, mask=ok, other=0).to(tl.int32)
        byte = byte | (tl.load(data + row + first + 1, mask=ok & (first + 1 < ROW_BYTES), other=0).to(tl.int32) << 8)
        shift = index * BITS % 8
    return (byte >> shift) & ((1 << BITS) - 1)


@triton.jit
def _params(ptr, length, t, t0, t_ok, c, c0, c_ok, D: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
            BLOCK_T: tl.constexpr):
    """Packed ints' scale or zero of each value of a tile (see :func:`_tile`) as float32 ``[BLOCK_T, C]``: per-channel
    groups of ``GROUP`` tokens (``[T/G, D]``) or per-token groups of ``GROUP`` channels (``[T, D/G]``). Where the
    tile spans at most two groups (per-channel groups when ``BLOCK_T <= GROUP``; per-token groups when a half of
    the channels holds at most two) each parameter is loaded once per tile and selected per token or channel in
    registers, instead of one gathered load per value."""
    if PER_CHANNEL and BLOCK_T <= GROUP:  # one or two rows of per-channel parameters
        first = t0 // GROUP
        second_ok = c_ok & (tl.zeros_like(c) + first + 1 < length // GROUP)
        p = tl.where((t // GROUP == first)[:, None], tl.load(ptr + first * D + c, mask=c_ok, other=0.0).to(tl.float32)[None, :],
                     tl.load(ptr + (first + 1) * D + c, mask=second_ok, other=0.0).to(tl.float32)[None, :])
    elif not PER_CHANNEL and (D // 2 <= GROUP or D // 2 == 2 * GROUP):  # two columns of per-token parameters
        param = t * (D // GROUP) + c0 // GROUP
        second_ok = t_ok & (tl.zeros_like(t) + c0 // GROUP + 1 < D // GROUP)
        p = tl.where((c // GROUP == c0 // GROUP)[None, :], tl.load(ptr + param, mask=t_ok, other=0.0).to(tl.float32)[:, None],
                     tl.load(ptr + param + 1, mask=second_ok, other=0.0).to(tl.float32)[:, None])
    else:  # a gathered load per value
        if PER_CHANNEL:
            param = (t[:, None] // GROUP) * D + c[None, :]
        else:
            param = t[:, None] * (D // GROUP) + c[None, :] // GROUP
        p = tl.load(ptr + param, mask=t_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
    return p


@triton.jit
def _tile(
    data, scale, zero, codebooks, ch_scale, ch_center, tok_scale, tok_center, length, t, t0, t_ok, c, c0, c_ok,
    D: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
    CODE_BITS: tl.constexpr, CENTROIDS: tl.constexpr, TL: tl.constexpr, CL: tl.constexpr, GC: tl.constexpr,
    TOKEN_SCALE: tl.constexpr, TOKEN_CENTER: tl.constexpr, LEVELS: tl.constexpr, MULTIPLIER: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Payload tokens ``t`` (the first is ``t0``) x channels ``c`` (the first is ``c0``) of one encoded stream
    (tensors at the program's sequence and head, :func:`_bases`) as a float32 tile; rows outside ``t_ok`` hold
    anything finite. ``LEVELS`` (packed ints only): each code names a value of ``codebooks`` (NVFP4's e2m1
    values), times its group's scale, no zero-point. ``MULTIPLIER`` (packed ints only, 0: none): the group of the
    multiplier (``tok_scale``) along the other axis than the parameters: ``D`` (per token) or tokens per row."""
    ok = t_ok[:, None] & c_ok[None, :]
    if FMT == 1:  # packed ints: x = code * scale + zero, or a small float format: x = levels[code] * scale
        code = _codes(data, t[:, None] * ((D * BITS + 7) // 8), c[None, :], ok, BITS, (D * BITS + 7) // 8)
        s = _params(scale, length, t, t0, t_ok, c, c0, c_ok, D, GROUP, PER_CHANNEL, BLOCK_T)
        if LEVELS:
            x = tl.load(codebooks + code, mask=ok, other=0.0) * s
        else:
            x = code.to(tl.float32) * s + _params(zero, length, t, t0, t_ok, c, c0, c_ok, D, GROUP, PER_CHANNEL, BLOCK_T)
        if MULTIPLIER > 0:  # KVarN's normaliser, along the other axis: per token, or per channel every MULTIPLIER tokens
            x = x * _params(tok_scale, length, t, t0, t_ok, c, c0, c_ok, D, MULTIPLIER, not PER_CHANNEL, BLOCK_T)
    elif FMT == 3:  # sign bits times a per-token norm (TurboQuant-prod's value sketch, read in the sketch's basis)
        x = _signs(data, t, D // 8, c, ok) * tl.load(scale + t, mask=t_ok, other=0.0).to(tl.float32)[:, None]
    elif FMT == 4:  # float8 or int8 values (the pointer's element type) times a per-tensor or per-token scale
        x = tl.load(data + t[:, None] * D + c[None, :], mask=ok, other=0.0).to(tl.float32)
        if TOKEN_SCALE:
            x = x * tl.load(scale + t, mask=t_ok, other=0.0).to(tl.float32)[:, None]
        else:
            x = x * tl.load(scale).to(tl.float32)
    else:  # codebook: gather the centroid entry, then undo the normalisation
        ROW_BYTES: tl.constexpr = ((D // CL) * CODE_BITS + 7) // 8
        code = _codes(data, (t[:, None] // TL) * ROW_BYTES, (c // CL)[None, :], ok, CODE_BITS, ROW_BYTES)
        entry = (t % TL)[:, None] * CL + (c % CL)[None, :]
        centroid = (c // GC)[None, :] * CENTROIDS + code
        z = tl.load(codebooks + centroid * (TL * CL) + entry, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(ch_scale + c, mask=c_ok, other=0.0)[None, :]
        center = tl.load(ch_center + c, mask=c_ok, other=0.0)[None, :]
        if TOKEN_SCALE:
            s = s * tl.load(tok_scale + t, mask=t_ok, other=0.0).to(tl.float32)[:, None]
        if TOKEN_CENTER:
            center = center + tl.load(tok_center + t, mask=t_ok, other=0.0).to(tl.float32)[:, None]
        x = z * s + center
    return x


@triton.jit
def _halves(
    data, scale, zero, codebooks, ch_scale, ch_center, tok_scale, tok_center, length, t, t0, t_ok, c, c_ok,
    D: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
    CODE_BITS: tl.constexpr, CENTROIDS: tl.constexpr, TL: tl.constexpr, CL: tl.constexpr, GC: tl.constexpr,
    TOKEN_SCALE: tl.constexpr, TOKEN_CENTER: tl.constexpr, UNIT: tl.constexpr, LEVELS: tl.constexpr,
    MULTIPLIER: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """The two channel halves ``[0, D/2)`` and ``[D/2, D)`` of one encoded stream's tile (see :func:`_tile`).
    ``UNIT`` (codebook payloads, vLLM's norm correction): each token's decoded vector is rescaled to unit norm
    over both halves, then times its token scale."""
    SCALED: tl.constexpr = TOKEN_SCALE and not UNIT
    lo = _tile(data, scale, zero, codebooks, ch_scale, ch_center, tok_scale, tok_center, length, t, t0, t_ok, c, 0, c_ok,
               D, FMT, BITS, GROUP, PER_CHANNEL, CODE_BITS, CENTROIDS, TL, CL, GC, SCALED, TOKEN_CENTER, LEVELS, MULTIPLIER,
               BLOCK_T)
    hi = _tile(data, scale, zero, codebooks, ch_scale, ch_center, tok_scale, tok_center, length, t, t0, t_ok, c + D // 2,
               D // 2, c_ok, D, FMT, BITS, GROUP, PER_CHANNEL, CODE_BITS, CENTROIDS, TL, CL, GC, SCALED, TOKEN_CENTER,
               LEVELS, MULTIPLIER, BLOCK_T)
    if UNIT:  # channels outside c_ok are 0 (_tile)
        norm = tl.sqrt(tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1))
        factor = tl.load(tok_scale + t, mask=t_ok, other=0.0).to(tl.float32) / tl.maximum(norm, TINY)
        lo = lo * factor[:, None]
        hi = hi * factor[:, None]
    return lo, hi


@triton.jit
def _dense(ptr, g, g_ok, c, c_ok, D: tl.constexpr):
    """Cached tokens ``g`` x channels ``c`` of a full-precision piece as float32, zero outside ``g_ok``
    (``ptr``: where cached token 0 of the program's sequence and head would lie; tokens ``D`` apart)."""
    return tl.load(ptr + g[:, None] * D + c[None, :], mask=g_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _dense_pick(which, d0, d1, d2, g, g_ok, c, c_ok, D: tl.constexpr):
    """:func:`_dense` of full-precision piece ``which`` (0-2) of a stream (sinks, tail, fresh token: separate tensors)."""
    if which == 0:
        x = _dense(d0, g, g_ok, c, c_ok, D)
    elif which == 1:
        x = _dense(d1, g, g_ok, c, c_ok, D)
    else:
        x = _dense(d2, g, g_ok, c, c_ok, D)
    return x


@triton.jit
def _piece(g0, cut1, cut2, cut3, hi, ENCODED: tl.constexpr):
    """Which piece of a stream holds cached token ``g0`` and where it ends: the stream's pieces in the launch
    lie in token order, separated at ``cut1 < cut2 < cut3`` (unused cuts: ``hi``); piece ``ENCODED`` is its
    payload (returned as 3), the others its full-precision pieces 0-2 in order. Few live registers: three
    bounds per stream."""
    position = (g0 >= cut1).to(tl.int32) + (g0 >= cut2).to(tl.int32) + (g0 >= cut3).to(tl.int32)
    stop = tl.where(position == 0, cut1, tl.where(position == 1, cut2, tl.where(position == 2, cut3, hi)))
    which = tl.where(position == ENCODED, 3, position - (position > ENCODED).to(tl.int32))
    return which, tl.maximum(stop, g0 + 1)


@triton.jit
def _row_scores(q, k, rows, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """``q [BLOCK_R, C] . k [BLOCK_T, C]^T`` one query row at a time: each row's products are a
    ``[BLOCK_T, C]`` tile reduced in registers, so the live products do not grow with the query rows
    (a ``[BLOCK_R, BLOCK_T, C]`` broadcast needs twice the registers per token, see
    ``scripts/kernel_resources.py``)."""
    s = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
    for r in tl.static_range(BLOCK_R):
        pick = rows[:, None] == r
        q_r = tl.sum(tl.where(pick, q, 0.0), 0)
        s = tl.where(pick, tl.sum(k * q_r[None, :], 1)[None, :], s)
    return s


@triton.jit
def _row_values(p, v, rows, BLOCK_R: tl.constexpr, C: tl.constexpr):
    """``p [BLOCK_R, BLOCK_T] @ v [BLOCK_T, C]`` one query row at a time (see :func:`_row_scores`)."""
    out = tl.zeros((BLOCK_R, C), dtype=tl.float32)
    for r in tl.static_range(BLOCK_R):
        pick = rows[:, None] == r
        p_r = tl.sum(tl.where(pick, p, 0.0), 0)
        out = tl.where(pick, tl.sum(p_r[:, None] * v, 0)[None, :], out)
    return out


@triton.jit
def _scores(q_lo, q_hi, k_lo, k_hi, rows, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr):
    """Logits ``[BLOCK_R, BLOCK_T]`` (log2 units) of key halves: ``tl.dot`` or in registers, one query row at a time."""
    if DOT:
        s = tl.dot(q_lo, tl.trans(k_lo)) + tl.dot(q_hi, tl.trans(k_hi))
    else:
        s = _row_scores(q_lo, k_lo, rows, BLOCK_R, BLOCK_T) + _row_scores(q_hi, k_hi, rows, BLOCK_R, BLOCK_T)
    return s


@triton.jit
def _weighted(acc_lo, acc_hi, alpha, p, v_lo, v_hi, rows, BLOCK_R: tl.constexpr, HALF_PAD: tl.constexpr, DOT: tl.constexpr):
    """The head_dim-layout accumulator halves rescaled by ``alpha`` plus ``P V``."""
    if DOT:
        acc_lo = acc_lo * alpha[:, None] + tl.dot(p, v_lo)
        acc_hi = acc_hi * alpha[:, None] + tl.dot(p, v_hi)
    else:
        acc_lo = acc_lo * alpha[:, None] + _row_values(p, v_lo, rows, BLOCK_R, HALF_PAD)
        acc_hi = acc_hi * alpha[:, None] + _row_values(p, v_hi, rows, BLOCK_R, HALF_PAD)
    return acc_lo, acc_hi


@triton.jit
def _dense_scores(
    which, d0, d1, d2, q_lo, q_hi, rows, g, g_ok, c, c_ok,
    D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, DOT: tl.constexpr,
):
    """Logits of a tile of full-precision keys (piece ``which``)."""
    k_lo = _dense_pick(which, d0, d1, d2, g, g_ok, c, c_ok, D)
    k_hi = _dense_pick(which, d0, d1, d2, g, g_ok, c + D // 2, c_ok, D)
    return _scores(q_lo, q_hi, k_lo, k_hi, rows, BLOCK_R, BLOCK_T, DOT)


@triton.jit
def _dense_weighted(
    acc_lo, acc_hi, alpha, p, which, d0, d1, d2, rows, g, g_ok, c, c_ok,
    D: tl.constexpr, BLOCK_R: tl.constexpr, HALF_PAD: tl.constexpr, DOT: tl.constexpr,
):
    """:func:`_weighted` of a tile of full-precision values (piece ``which``)."""
    v_lo = _dense_pick(which, d0, d1, d2, g, g_ok, c, c_ok, D)
    v_hi = _dense_pick(which, d0, d1, d2, g, g_ok, c + D // 2, c_ok, D)
    return _weighted(acc_lo, acc_hi, alpha, p, v_lo, v_hi, rows, BLOCK_R, HALF_PAD, DOT)


@triton.jit
def _packed_scores(
    q_ptr, R, rows, row_ok, qk_scale, data, scale, zero, length, t, t0, t_ok,
    D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr, DOT: tl.constexpr,
):
    """Logits ``[BLOCK_R, BLOCK_T]`` of packed-int keys in their stored layout: each byte of the tile is
    loaded once, and each of its ``8 / BITS`` fields (channels ``PER_BYTE * i + j``) meets the matching
    query sub-vector, instead of one byte load per channel."""
    PER_BYTE: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // PER_BYTE
    i = tl.arange(0, W)
    ok = t_ok[:, None]
    byte = tl.load(data + t[:, None] * W + i[None, :], mask=ok, other=0).to(tl.int32)  # [BLOCK_T, W]
    s = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
    for j in tl.static_range(PER_BYTE):
        channel = i * PER_BYTE + j
        code = ((byte >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        if PER_CHANNEL and BLOCK_T <= GROUP:  # one or two rows of per-channel parameters (see _tile)
            first = t0 // GROUP
            second_ok = tl.zeros_like(i) + first + 1 < length // GROUP
            in_first = (t // GROUP == first)[:, None]
            sc = tl.where(in_first, tl.load(scale + first * D + channel).to(tl.float32)[None, :],
                          tl.load(scale + (first + 1) * D + channel, mask=second_ok, other=0.0).to(tl.float32)[None, :])
            zc = tl.where(in_first, tl.load(zero + first * D + channel).to(tl.float32)[None, :],
                          tl.load(zero + (first + 1) * D + channel, mask=second_ok, other=0.0).to(tl.float32)[None, :])
        else:
            if PER_CHANNEL:
                param = (t[:, None] // GROUP) * D + channel[None, :]
            else:
                param = t[:, None] * (D // GROUP) + channel[None, :] // GROUP
            sc = tl.load(scale + param, mask=ok, other=0.0).to(tl.float32)
            zc = tl.load(zero + param, mask=ok, other=0.0).to(tl.float32)
        k = code * sc + zc  # [BLOCK_T, W]
        if DOT:
            q = tl.load(q_ptr + rows[:, None] * D + channel[None, :], mask=row_ok[:, None], other=0.0)
            s += tl.dot(q.to(tl.float32) * qk_scale, tl.trans(k))  # q: the field's query sub-vectors [BLOCK_R, W]
        else:  # one query row at a time, its field sub-vector [W] loaded as is (L1-resident)
            for r in tl.static_range(BLOCK_R):
                q_r = tl.load(q_ptr + r * D + channel, mask=tl.zeros_like(channel) + r < R, other=0.0)
                s_r = tl.sum(k * (q_r.to(tl.float32) * qk_scale)[None, :], 1)
                s = tl.where(rows[:, None] == r, s + s_r[None, :], s)
    return s


@triton.jit
def _packed_values(
    p, rows, data, scale, zero, t, t_ok,
    D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """``P V`` of per-token packed-int values in their stored layout, ``[BLOCK_R, 8 / BITS, W]`` where
    ``[r, j, i]`` is channel ``PER_BYTE * i + j``: each byte of the tile is loaded once and each of its
    fields is weighted as it lies; the caller keeps this field-major accumulator and writes it to the
    head_dim layout once, at the end. Byte ``i`` lies in per-token group ``i // (GROUP / PER_BYTE)`` for
    every field, so a token's few group scales are loaded once and selected per byte in registers."""
    PER_BYTE: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // PER_BYTE
    GROUPS: tl.constexpr = D // GROUP
    i = tl.arange(0, W)
    byte = tl.load(data + t[:, None] * W + i[None, :], mask=t_ok[:, None], other=0).to(tl.int32)  # [BLOCK_T, W]
    group_of = (i // (GROUP // PER_BYTE))[None, :]
    sc = tl.zeros((BLOCK_T, W), dtype=tl.float32)
    zc = tl.zeros((BLOCK_T, W), dtype=tl.float32)
    for k in tl.static_range(GROUPS):
        sc = tl.where(group_of == k, tl.load(scale + t * GROUPS + k, mask=t_ok, other=0.0).to(tl.float32)[:, None], sc)
        zc = tl.where(group_of == k, tl.load(zero + t * GROUPS + k, mask=t_ok, other=0.0).to(tl.float32)[:, None], zc)
    field = tl.arange(0, PER_BYTE)[None, :, None]
    out = tl.zeros((BLOCK_R, PER_BYTE, W), dtype=tl.float32)
    for j in tl.static_range(PER_BYTE):
        v = ((byte >> (j * BITS)) & ((1 << BITS) - 1)).to(tl.float32) * sc + zc  # channels PER_BYTE * i + j
        out = tl.where(field == j, _row_values(p, v, rows, BLOCK_R, W)[:, None, :], out)
    return out


@triton.jit
def _dense_fields(
    which, d0, d1, d2, p, rows, g, g_ok,
    D: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """``P V`` of full-precision values into the field-major accumulator of :func:`_packed_values` (the
    few full-precision tokens of a stream whose payload is weighted in its packed layout)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    W: tl.constexpr = D // PER_BYTE
    i = tl.arange(0, W)
    field = tl.arange(0, PER_BYTE)[None, :, None]
    out = tl.zeros((BLOCK_R, PER_BYTE, W), dtype=tl.float32)
    for j in tl.static_range(PER_BYTE):
        v = _dense_pick(which, d0, d1, d2, g, g_ok, i * PER_BYTE + j, i < W, D)
        out = tl.where(field == j, _row_values(p, v, rows, BLOCK_R, W)[:, None, :], out)
    return out


@triton.jit
def _signs(packed, row, row_bytes, m, ok):
    """``+-1`` float32 ``[rows, sketch rows m]`` from sign bits packed 8 per byte (bit ``m % 8`` of byte ``m // 8``)."""
    byte = tl.load(packed + row[:, None] * row_bytes + m[None, :] // 8, mask=ok, other=0).to(tl.int32)
    return ((byte >> (m[None, :] % 8)) & 1).to(tl.float32) * 2.0 - 1.0


@triton.jit
def _sketch_scores(
    q_ptr, R, rows, row_ok, qk_scale, signs, norm, t, t0, t_ok,
    y_ptr, proj, out_signs, out_norm, channels, scale_in, scale_out,
    D: tl.constexpr, M: tl.constexpr, M_OUT: tl.constexpr, N_OUT: tl.constexpr, GROUP: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Logits ``[BLOCK_R, BLOCK_T]`` of QJL's sign-sketched keys (:mod:`kvcomp.kernels.qjl_scores`):
    ``sqrt(pi/2)/m ||k_in|| <S q - u_g, sign(S k_in)> + sqrt(pi/2)/m_o ||k_out|| <u_g[:m_o], sign(S_{:m_o} k_out)>``
    with ``y = S q`` precomputed per query and ``u_g = S[:, O_g] q_{O_g}`` built here from ``N_OUT`` columns
    of ``S`` for the tile's group (tiles never straddle a group: ``BLOCK_T`` divides ``GROUP`` and tiles
    end at multiples of ``BLOCK_T`` from the payload's first token). Sketch rows are padded to ``M_PAD``, a
    power of two, and the padding contributes nothing (``y = 0``, ``S = 0``, no sign bits)."""
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    ok = t_ok[:, None] & m_ok[None, :]
    sign = _signs(signs, t, M // 8, m, ok)  # [BLOCK_T, M_PAD]
    y = tl.load(y_ptr + rows[:, None] * M + m[None, :], mask=row_ok[:, None] & m_ok[None, :], other=0.0)
    if N_OUT > 0:
        group = t0 // GROUP
        u = tl.zeros((BLOCK_R, M_PAD), dtype=tl.float32)
        for o in tl.static_range(N_OUT):
            channel = tl.load(channels + group * N_OUT + o).to(tl.int32)
            q_c = tl.load(q_ptr + rows * D + channel, mask=row_ok, other=0.0).to(tl.float32)
            u += q_c[:, None] * tl.load(proj + m * D + channel, mask=m_ok, other=0.0)[None, :]
        y = y - u
    inlier = tl.load(norm + t, mask=t_ok, other=0.0).to(tl.float32)
    s = _row_scores(y, sign, rows, BLOCK_R, BLOCK_T) * (scale_in * inlier)[None, :]  # padded rows: y = 0
    if N_OUT > 0:
        first_rows = m < M_OUT
        sign = tl.where(first_rows[None, :], _signs(out_signs, t, M_OUT // 8, m, ok & first_rows[None, :]), 0.0)
        outlier = tl.load(out_norm + t, mask=t_ok, other=0.0).to(tl.float32)
        s += _row_scores(u, sign, rows, BLOCK_R, BLOCK_T) * (scale_out * outlier)[None, :]
    return s * qk_scale


@triton.jit
def _rotate(lo, hi, positions, inv_freq, rope_scaling, g, g_ok, c, c_ok, ROUND: tl.constexpr):
    """RoPE of the two channel halves at the positions of cached tokens ``g`` (``positions``: the program's
    sequence); cos/sin rounded to the model's dtype like the rotary embedding's output (ROUND 1: bfloat16,
    2: float16)."""
    pos = tl.load(positions + g, mask=g_ok, other=0).to(tl.float32)
    angle = pos[:, None] * tl.load(inv_freq + c, mask=c_ok, other=0.0)[None, :]
    cos = tl.cos(angle) * rope_scaling
    sin = tl.sin(angle) * rope_scaling
    if ROUND == 1:
        cos, sin = cos.to(tl.bfloat16).to(tl.float32), sin.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        cos, sin = cos.to(tl.float16).to(tl.float32), sin.to(tl.float16).to(tl.float32)
    return lo * cos - hi * sin, hi * cos + lo * sin


@triton.jit(do_not_specialize=[
    "valid_s_b", "lo", "hi", "tiles", "slot0", "num_slots", "pos_stride", "k_tok_s_h", "v_tok_s_h",
    *(f"{s}_{name}" for s in "kv" for name in ("d0_lo", "d1_lo", "d2_lo", "cut1", "cut2", "cut3", "length", "first")),
])
def _split_kernel(
    q_ptr, part_ptr, lse_ptr, valid_ptr, valid_s_b,
    H, R, lo, hi, tiles, unit, slot0, num_slots, qk_scale,
    k_d0, k_d0_s_b, k_d0_s_h, k_d0_lo, k_d1, k_d1_s_b, k_d1_s_h, k_d1_lo, k_d2, k_d2_s_b, k_d2_s_h, k_d2_lo,
    k_cut1, k_cut2, k_cut3,
    k_data, k_scale, k_zero, k_codebooks, k_ch_scale, k_ch_center, k_tok_scale, k_tok_center, k_length, k_first,
    k_data_s_b, k_data_s_h, k_param_s_b, k_param_s_h, k_tok_s_b, k_tok_s_h,
    v_d0, v_d0_s_b, v_d0_s_h, v_d0_lo, v_d1, v_d1_s_b, v_d1_s_h, v_d1_lo, v_d2, v_d2_s_b, v_d2_s_h, v_d2_lo,
    v_cut1, v_cut2, v_cut3,
    v_data, v_scale, v_zero, v_codebooks, v_ch_scale, v_ch_center, v_tok_scale, v_tok_center, v_length, v_first,
    v_data_s_b, v_data_s_h, v_param_s_b, v_param_s_h, v_tok_s_b, v_tok_s_h,
    positions, pos_stride, inv_freq, rope_scaling, q0_ptr, offset_ptr,
    sk_y, sk_proj, sk_out_signs, sk_out_norm, sk_channels, sk_scale_in, sk_scale_out,
    sk_out_s_b, sk_out_s_h, sk_onorm_s_b, sk_onorm_s_h, sk_ch_s_b, sk_ch_s_h,
    sk_res_signs, sk_res_norm, sk_res_s_b, sk_res_s_h, sk_rnorm_s_b, sk_rnorm_s_h,
    D: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    K_FMT: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr, K_PER_CHANNEL: tl.constexpr,
    K_CODE_BITS: tl.constexpr, K_CENTROIDS: tl.constexpr, K_TL: tl.constexpr, K_CL: tl.constexpr, K_GC: tl.constexpr,
    K_TOKEN_SCALE: tl.constexpr, K_TOKEN_CENTER: tl.constexpr, K_UNIT: tl.constexpr, K_LEVELS: tl.constexpr,
    K_MULTIPLIER: tl.constexpr, K_ENCODED: tl.constexpr,
    V_FMT: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr, V_PER_CHANNEL: tl.constexpr,
    V_CODE_BITS: tl.constexpr, V_CENTROIDS: tl.constexpr, V_TL: tl.constexpr, V_CL: tl.constexpr, V_GC: tl.constexpr,
    V_TOKEN_SCALE: tl.constexpr, V_TOKEN_CENTER: tl.constexpr, V_UNIT: tl.constexpr, V_LEVELS: tl.constexpr,
    V_MULTIPLIER: tl.constexpr, V_ENCODED: tl.constexpr,
    ROPE: tl.constexpr, ROUND: tl.constexpr, DOT: tl.constexpr, PACKED_K: tl.constexpr, OFFSET: tl.constexpr,
    SK_M: tl.constexpr, SK_M_OUT: tl.constexpr, SK_N_OUT: tl.constexpr, SK_GROUP: tl.constexpr, SK_M_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    PACKED_V: tl.constexpr, K_RESIDUAL: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    splits = tl.num_programs(1)  # the launch's tiles of ``unit`` tokens, shared out evenly (+-1 tile)
    split_lo = lo + (split * tiles // splits) * unit
    split_hi = tl.minimum(lo + ((split + 1) * tiles // splits) * unit, hi)

    # every tensor advanced to this program's sequence and head once (int64 offsets)
    q_ptr += bh * R * D
    k_d0 += b64 * k_d0_s_b + h * k_d0_s_h - k_d0_lo * D
    k_d1 += b64 * k_d1_s_b + h * k_d1_s_h - k_d1_lo * D
    k_d2 += b64 * k_d2_s_b + h * k_d2_s_h - k_d2_lo * D
    v_d0 += b64 * v_d0_s_b + h * v_d0_s_h - v_d0_lo * D
    v_d1 += b64 * v_d1_s_b + h * v_d1_s_h - v_d1_lo * D
    v_d2 += b64 * v_d2_s_b + h * v_d2_s_h - v_d2_lo * D
    k_data, k_scale, k_zero, k_codebooks, k_ch_scale, k_ch_center, k_tok_scale, k_tok_center = _bases(
        b64, h64, k_data, k_scale, k_zero, k_codebooks, k_ch_scale, k_ch_center, k_tok_scale, k_tok_center,
        k_data_s_b, k_data_s_h, k_param_s_b, k_param_s_h, k_tok_s_b, k_tok_s_h, D, K_FMT, K_CENTROIDS, K_TL, K_CL, K_GC)
    v_data, v_scale, v_zero, v_codebooks, v_ch_scale, v_ch_center, v_tok_scale, v_tok_center = _bases(
        b64, h64, v_data, v_scale, v_zero, v_codebooks, v_ch_scale, v_ch_center, v_tok_scale, v_tok_center,
        v_data_s_b, v_data_s_h, v_param_s_b, v_param_s_h, v_tok_s_b, v_tok_s_h, D, V_FMT, V_CENTROIDS, V_TL, V_CL, V_GC)
    if K_FMT == 3:  # sketched keys (sign bits and norms per token: _bases): outlier sketches and channel ids
        sk_out_signs += b64 * sk_out_s_b + h64 * sk_out_s_h
        sk_out_norm += b64 * sk_onorm_s_b + h64 * sk_onorm_s_h
        sk_channels += b64 * sk_ch_s_b + h64 * sk_ch_s_h
    if K_RESIDUAL:  # keys plus the sign sketch of their residual (TurboQuant-prod): its bits and norms per token
        sk_res_signs += b64 * sk_res_s_b + h64 * sk_res_s_h
        sk_res_norm += b64 * sk_rnorm_s_b + h64 * sk_rnorm_s_h
    if K_FMT == 3 or K_RESIDUAL:
        sk_y += bh * R * SK_M
    positions += b64 * pos_stride
    valid_ptr += b64 * valid_s_b

    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < R
    c = tl.arange(0, HALF_PAD)
    c_ok = c < D // 2
    q_at = q_ptr + rows[:, None] * D + c[None, :]
    q_mask = row_ok[:, None] & c_ok[None, :]
    q_lo = tl.load(q_at, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    q_hi = tl.load(q_at + D // 2, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
    if OFFSET:  # a rotated key offset: the query as the model made it (q_ptr: rotated with the payload) and c
        q0_at = q0_ptr + bh * R * D + rows[:, None] * D + c[None, :]
        q0_lo = tl.load(q0_at, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
        q0_hi = tl.load(q0_at + D // 2, mask=q_mask, other=0.0).to(tl.float32) * qk_scale
        off_lo = tl.load(offset_ptr + h * D + c, mask=c_ok, other=0.0)
        off_hi = tl.load(offset_ptr + h * D + D // 2 + c, mask=c_ok, other=0.0)

    m_i = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_R,), dtype=tl.float32)
    V_PER_BYTE: tl.constexpr = 8 // V_BITS
    if PACKED_V:  # field-major: [r, j, i] is channel V_PER_BYTE * i + j
        acc = tl.zeros((BLOCK_R, V_PER_BYTE, D // V_PER_BYTE), dtype=tl.float32)
    else:
        acc_lo = tl.zeros((BLOCK_R, HALF_PAD), dtype=tl.float32)
        acc_hi = tl.zeros((BLOCK_R, HALF_PAD), dtype=tl.float32)
    align = k_first % BLOCK_T  # tiles end at multiples of BLOCK_T from the key payload's first token
    g0 = split_lo
    while g0 < split_hi:  # one tile per iteration, within one piece of each stream
        k_which, k_stop = _piece(g0, k_cut1, k_cut2, k_cut3, hi, K_ENCODED)
        v_which, v_stop = _piece(g0, v_cut1, v_cut2, v_cut3, hi, V_ENCODED)
        end = tl.minimum(tl.minimum(split_hi, g0 + BLOCK_T - (g0 + BLOCK_T - align) % BLOCK_T), tl.minimum(k_stop, v_stop))
        g = g0 + tl.arange(0, BLOCK_T)
        g_ok = g < end
        if MASKED:  # the step's attention mask, one byte per cached token (any pattern: no host check)
            g_ok = g_ok & (tl.load(valid_ptr + g, mask=g_ok, other=0) != 0)
        if K_FMT == 0:  # no encoded keys in this launch
            s = _dense_scores(k_which, k_d0, k_d1, k_d2, q_lo, q_hi, rows, g, g_ok, c, c_ok, D, BLOCK_R, BLOCK_T, DOT)
        elif k_which == 3:  # the encoded payload
            t = g - k_first
            if K_FMT == 3:
                s = _sketch_scores(q_ptr, R, rows, row_ok, qk_scale, k_data, k_scale, t, g0 - k_first, g_ok, sk_y, sk_proj,
                                   sk_out_signs, sk_out_norm, sk_channels, sk_scale_in, sk_scale_out,
                                   D, SK_M, SK_M_OUT, SK_N_OUT, SK_GROUP, SK_M_PAD, BLOCK_R, BLOCK_T)
            elif PACKED_K:  # packed-int keys in their stored layout
                s = _packed_scores(q_ptr, R, rows, row_ok, qk_scale, k_data, k_scale, k_zero, k_length, t, g0 - k_first, g_ok,
                                   D, K_BITS, K_GROUP, K_PER_CHANNEL, BLOCK_R, BLOCK_T, DOT)
            else:
                k_lo, k_hi = _halves(k_data, k_scale, k_zero, k_codebooks, k_ch_scale, k_ch_center, k_tok_scale, k_tok_center,
                                     k_length, t, g0 - k_first, g_ok, c, c_ok, D, K_FMT, K_BITS, K_GROUP, K_PER_CHANNEL,
                                     K_CODE_BITS, K_CENTROIDS, K_TL, K_CL, K_GC, K_TOKEN_SCALE, K_TOKEN_CENTER, K_UNIT, K_LEVELS,
                                     K_MULTIPLIER, BLOCK_T)
                if ROPE:
                    k_lo, k_hi = _rotate(k_lo, k_hi, positions, inv_freq, rope_scaling, g, g_ok, c, c_ok, ROUND)
                s = _scores(q_lo, q_hi, k_lo, k_hi, rows, BLOCK_R, BLOCK_T, DOT)
            if K_RESIDUAL:  # + sqrt(pi/2)/d ||r|| <S q, sign(S r)>, S q of the model's query (sk_y)
                s += _sketch_scores(q_ptr, R, rows, row_ok, qk_scale, sk_res_signs, sk_res_norm, t, g0 - k_first, g_ok,
                                    sk_y, sk_proj, sk_out_signs, sk_out_norm, sk_channels, sk_scale_in, sk_scale_out,
                                    D, SK_M, SK_M_OUT, 0, SK_GROUP, SK_M_PAD, BLOCK_R, BLOCK_T)
            if OFFSET:  # + q . R_p c: the offset rotated to each token's position, scored with the model's query
                o_lo, o_hi = _rotate(tl.zeros((BLOCK_T, HALF_PAD), tl.float32) + off_lo[None, :],
                                     tl.zeros((BLOCK_T, HALF_PAD), tl.float32) + off_hi[None, :],
                                     positions, inv_freq, rope_scaling, g, g_ok, c, c_ok, ROUND)
                s += _scores(q0_lo, q0_hi, o_lo, o_hi, rows, BLOCK_R, BLOCK_T, DOT)
        else:  # a full-precision piece
            s = _dense_scores(k_which, k_d0, k_d1, k_d2, q_lo, q_hi, rows, g, g_ok, c, c_ok, D, BLOCK_R, BLOCK_T, DOT)
        s = tl.where(g_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if V_FMT != 0:
            if v_which == 3:  # the encoded payload
                t = g - v_first
                if PACKED_V:  # packed-int values in their stored layout
                    acc = acc * alpha[:, None, None] + _packed_values(p, rows, v_data, v_scale, v_zero, t, g_ok,
                                                                      D, V_BITS, V_GROUP, BLOCK_R, BLOCK_T)
                else:
                    v_lo, v_hi = _halves(v_data, v_scale, v_zero, v_codebooks, v_ch_scale, v_ch_center, v_tok_scale,
                                         v_tok_center, v_length, t, g0 - v_first, g_ok, c, c_ok, D, V_FMT, V_BITS, V_GROUP,
                                         V_PER_CHANNEL, V_CODE_BITS, V_CENTROIDS, V_TL, V_CL, V_GC, V_TOKEN_SCALE,
                                         V_TOKEN_CENTER, V_UNIT, V_LEVELS, V_MULTIPLIER, BLOCK_T)
                    acc_lo, acc_hi = _weighted(acc_lo, acc_hi, alpha, p, v_lo, v_hi, rows, BLOCK_R, HALF_PAD, DOT)
            elif PACKED_V:  # a full-precision piece, into the field-major accumulator
                acc = acc * alpha[:, None, None] + _dense_fields(v_which, v_d0, v_d1, v_d2, p, rows, g, g_ok, D, V_BITS, BLOCK_R)
            else:
                acc_lo, acc_hi = _dense_weighted(acc_lo, acc_hi, alpha, p, v_which, v_d0, v_d1, v_d2, rows, g, g_ok, c, c_ok,
                                                 D, BLOCK_R, HALF_PAD, DOT)
        else:  # no encoded values in this launch
            acc_lo, acc_hi = _dense_weighted(acc_lo, acc_hi, alpha, p, v_which, v_d0, v_d1, v_d2, rows, g, g_ok, c, c_ok,
                                             D, BLOCK_R, HALF_PAD, DOT)
        m_i = m_new
        g0 = end

    filled = l_i > 0
    inv_l = 1.0 / tl.where(filled, l_i, 1.0)
    slot = bh * num_slots + slot0 + split
    if PACKED_V:  # the field-major accumulator written to the head_dim layout
        field = tl.arange(0, V_PER_BYTE)[None, :, None]
        byte = tl.arange(0, D // V_PER_BYTE)[None, None, :]
        out_at = part_ptr + (slot * R + rows[:, None, None]) * D + byte * V_PER_BYTE + field
        tl.store(out_at, acc * inv_l[:, None, None], mask=row_ok[:, None, None])
    else:
        out_at = part_ptr + (slot * R + rows[:, None]) * D + c[None, :]
        tl.store(out_at, acc_lo * inv_l[:, None], mask=q_mask)
        tl.store(out_at + D // 2, acc_hi * inv_l[:, None], mask=q_mask)
    tl.store(lse_ptr + slot * R + rows, tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf")), mask=row_ok)


@triton.jit(do_not_specialize=["num_slots"])
def _merge_kernel(part_ptr, lse_ptr, out_ptr, R, num_slots, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    rows = tl.arange(0, BLOCK_R)
    row_ok = rows < R
    cols = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (cols < D)[None, :]
    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    for s in range(num_slots):
        m = tl.maximum(m, tl.load(lse_ptr + (bh * num_slots + s) * R + rows, mask=row_ok, other=float("-inf")))
    m = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    weight = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for s in range(num_slots):
        slot = bh * num_slots + s
        w = tl.exp2(tl.load(lse_ptr + slot * R + rows, mask=row_ok, other=float("-inf")) - m)
        acc += w[:, None] * tl.load(part_ptr + (slot * R + rows[:, None]) * D + cols[None, :], mask=mask, other=0.0)
        weight += w
    out = acc / tl.where(weight > 0, weight, 1.0)[:, None]
    tl.store(out_ptr + (bh * R + rows[:, None]) * D + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _stream_args(prefix: str, segments: list[Segment], bounds: list[int], indices: tuple, hi: int,
                 placeholder: torch.Tensor) -> dict:
    """Kernel arguments of one stream's segments ``indices`` (in token order; at most :data:`MAX_DENSE`
    full-precision pieces and one encoded payload) in a launch that ends at cached token ``hi``: runtime
    ``{prefix}_*`` and compile-time ``{PREFIX}_*``."""
    runtime = dict(data=placeholder, scale=placeholder, zero=placeholder, codebooks=placeholder, ch_scale=placeholder,
                   ch_center=placeholder, tok_scale=placeholder, tok_center=placeholder, length=0, first=0,
                   data_s_b=0, data_s_h=0, param_s_b=0, param_s_h=0, tok_s_b=0, tok_s_h=0)
    static = dict(FMT=DENSE, BITS=8, GROUP=1, PER_CHANNEL=False, CODE_BITS=8, CENTROIDS=1, TL=1, CL=1, GC=1,
                  TOKEN_SCALE=False, TOKEN_CENTER=False, UNIT=False, LEVELS=False, MULTIPLIER=0)
    dense, encoded_at = [], 4  # the payload's position among the pieces (4: none)
    for position, index in enumerate(indices):
        segment = segments[index]
        if isinstance(segment, torch.Tensor):
            dense.append((segment if segment.stride(-1) == 1 and (segment.shape[2] == 1 or segment.stride(2) == segment.shape[3])
                          else segment.contiguous(), bounds[index]))  # tokens head_dim apart
            continue
        encoded_at = position
        fields, constants = segment.kernel_args()
        runtime.update(fields, length=segment.num_tokens, first=bounds[index])
        static.update(constants)
    for i in range(MAX_DENSE):  # unused pieces: never read
        tensor, first = dense[i] if i < len(dense) else (placeholder, 0)
        s_b, s_h = tensor.stride()[:2] if tensor.dim() == 4 else (0, 0)
        runtime.update({f"d{i}": tensor, f"d{i}_s_b": s_b, f"d{i}_s_h": s_h, f"d{i}_lo": first})
    cuts = [bounds[index + 1] for index in indices[:-1]] + [hi] * (MAX_DENSE + 1 - len(indices))
    runtime.update(cut1=cuts[0], cut2=cuts[1], cut3=cuts[2])
    static.update(ENCODED=encoded_at)
    return {**{f"{prefix}_{k}": v for k, v in runtime.items()}, **{f"{prefix.upper()}_{k}": v for k, v in static.items()}}


def _sketch_args(segment: Segment, q: torch.Tensor, placeholder: torch.Tensor, queries: dict,
                 residual: tuple[torch.Tensor, SignReader] | None = None) -> dict:
    """The ``sk_*`` / ``SK_*`` arguments of sketched keys (:meth:`~kvcomp.kernels.payloads.SketchReader.sketch_args`),
    or of the residual sketch of encoded keys (``residual``: ``(y, signs)``, ``y = S q`` ``[B, H, R, m]`` of the
    model's query); placeholders where neither, or no outliers."""
    out = dict(sk_y=placeholder, sk_proj=placeholder, sk_out_signs=placeholder, sk_out_norm=placeholder,
               sk_channels=placeholder, sk_scale_in=0.0, sk_scale_out=0.0, **dict.fromkeys(SKETCH_STRIDES, 0),
               sk_res_signs=placeholder, sk_res_norm=placeholder, sk_res_s_b=0, sk_res_s_h=0, sk_rnorm_s_b=0,
               sk_rnorm_s_h=0, SK_M=16, SK_M_OUT=16, SK_N_OUT=0, SK_GROUP=1, SK_M_PAD=16, K_RESIDUAL=False)
    if isinstance(segment, SketchReader):
        if residual is not None:
            raise ValueError("decode kernel: QJL's sketched keys have no residual sketch")
        return {**out, **segment.sketch_args(q, queries)}
    if residual is None or segment is None:
        return out
    y, signs = residual
    m = y.shape[-1]
    if m != signs.head_dim or m % 8:
        raise ValueError(f"decode kernel: a residual sketch has one sign bit per channel, in whole bytes; got {m} rows "
                         f"for head_dim {signs.head_dim}")
    (bits,), res_s_b, res_s_h = in_place(signs.signs)
    (norm,), rnorm_s_b, rnorm_s_h = in_place(signs.norm)
    return {**out, "sk_y": y, "sk_scale_in": estimator_scale(m), "SK_M": m, "SK_M_PAD": triton.next_power_of_2(m),
            "sk_res_signs": bits, "sk_res_norm": norm, "sk_res_s_b": res_s_b, "sk_res_s_h": res_s_h,
            "sk_rnorm_s_b": rnorm_s_b, "sk_rnorm_s_h": rnorm_s_h, "K_RESIDUAL": True}


def _kv_heads(segment: Segment) -> int:
    return segment.kv_heads if isinstance(segment, PayloadReader) else segment.shape[1]


def default_tile(segments: list[Segment], narrow: bool = False) -> int:
    """Tokens per tile by default: :data:`WIDE_TILE` where each payload is packed ints, a block float or codes of
    one shared codebook, which the H100 sweep of 2026-11-26 measured 1.3-1.7x faster at 16 x 32K (KVarN, vLLM's
    int4 and NVFP4, EDEN-2, TurboQuant k3v4; KIVI-2 unchanged at 1 and 16 x 32K and 1 x 4K); else :data:`TILE`,
    which per-group codebooks (TemporalKV, ChannelKV, KVQuant: 0.3-0.6x with 128) and QJL's sketches need, and
    which float8 and int8 payloads keep until they are measured. A launch that rotates keys or their offset in
    registers (the angles of every token of a tile), or scores a residual sketch (a ``[tokens, d]`` tile of signs), keeps
    :data:`TILE` too (``narrow``): EDEN-2 with ``center`` spills 744 B per thread at 128 tokens under Triton 3.6, 16 B
    at 32 (``scripts/kernel_resources.py``)."""
    wide = all(isinstance(s, torch.Tensor) or s.wide_tile for s in segments)
    return WIDE_TILE if wide and not narrow else TILE


def _tile_tokens(block_tokens: int, *segments: Segment, dot: bool) -> int:
    """Tokens per tile of one launch: at most what each payload allows
    (:meth:`~kvcomp.kernels.payloads.PayloadReader.tile_limit`: a per-channel group of packed ints, a QJL group)."""
    for segment in segments:
        block_tokens = segment.tile_limit(block_tokens, dot)
    return block_tokens


@functools.lru_cache(maxsize=None)
def _placeholder(device: torch.device) -> torch.Tensor:
    """A valid pointer for the kernel arguments a segment's format does not read (never written)."""
    return torch.zeros(1, device=device, dtype=torch.float32)


def _boundaries(segments: list[Segment]) -> list[int]:
    bounds = [0]
    for segment in segments:
        bounds.append(bounds[-1] + segment_length(segment))
    return bounds


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: a few slices, so that tests exercise the merge


def decode_launches(
    query: torch.Tensor,
    key_segments: list[Segment],
    value_segments: list[Segment],
    scale: float,
    valid: torch.Tensor | None = None,
    key_rope: RotaryPositions | None = None,
    num_splits: int | None = None,
    block_tokens: int | None = None,
    dot: bool | None = None,
    num_warps: int | None = None,
    key_offset: tuple[torch.Tensor, torch.Tensor, RotaryPositions] | None = None,
    key_residual: tuple[torch.Tensor, SignReader] | None = None,
    step: DecodeStep | None = None,
    region: int = 0,
) -> tuple[torch.Tensor, list[Launch]]:
    """The output buffer and the launches of :func:`decode_attention_triton`, without running them
    (``scripts/kernel_resources.py`` compiles them for a GPU that need not be present). ``key_rope``: the
    rotation of encoded keys of pre-RoPE codecs. ``num_splits``: slices per launch (default:
    :func:`~kvcomp.kernels.decode_plan._splits`, whole waves over the GPU's multiprocessors). ``dot``: ``tl.dot`` for
    scores and ``P V`` (default: unless the keys are QJL sketches and at most 8 query heads share a KV head, see
    :data:`WARPS`); ``block_tokens``: tokens per tile (default by format, :func:`default_tile`; fewer where a
    payload's groups need it, :func:`_tile_tokens`); ``num_warps``: warps per split program (default :data:`WARPS`; on the
    register path a program may take the register file's share of its warps). ``key_offset``: ``(query, c, positions)``
    of encoded keys stored less a pre-RoPE offset ``c [H, D]`` rotated to each token's position (``query``: the
    model's, where ``query`` here is rotated with the payload; ``positions``: of this launch's tokens from 0), whose
    score ``q . R_p c`` the kernel adds. ``key_residual``: ``(y, signs)`` of encoded keys plus the sign sketch of their
    residual (TurboQuant-prod: ``y = S q`` ``[B, H, R, d]`` of the model's query), whose score the kernel adds.
    ``step``: the forward's :class:`~kvcomp.kernels.decode_plan.DecodeStep` (its plan, made once for every layer,
    and its workspace, whose scratch region ``region`` takes the partial outputs; default: a step of its own).
    Only the slice counts depend on
    the device (its multiprocessors): ``scripts/kernel_resources.py`` compiles the launches of CPU tensors for sm_90."""
    b, hq, d = query.shape
    if d % 2:
        raise ValueError(f"decode kernel: head_dim={d} must be even")
    if any(isinstance(s, OWN_LAUNCHES) for s in key_segments + value_segments):
        raise ValueError("decode kernel: a rotated, offset or residual-sketch payload takes its own launches "
                         "(decode_attention_triton)")
    if key_rope is not None and key_offset is not None:
        raise ValueError("decode kernel: keys are pre-RoPE (key_rope) or carry a rotated offset (key_offset), not both")
    h = _kv_heads(key_segments[0])
    r = hq // h
    q = query.reshape(b, h, r, d).contiguous()
    device = query.device
    sketched = key_residual is not None or any(isinstance(segment, SketchReader) for segment in key_segments)
    if any(isinstance(segment, SignReader) for segment in key_segments):
        raise ValueError("decode kernel: sign bits are read as values, or as a key payload's residual (key_residual)")
    if dot is None:
        dot = r > 8 or not sketched
    block_r = max(16, triton.next_power_of_2(r)) if dot else triton.next_power_of_2(r)
    block_tokens = block_tokens or default_tile(key_segments + value_segments,
                                                key_rope is not None or key_offset is not None or key_residual is not None)
    num_warps = num_warps or WARPS
    # the whole register file's share of a program (ptxas in Triton 3.6 otherwise settles on 64 and spills)
    registers = {} if dot else {"maxnreg": min(255, 65536 // (32 * num_warps))}
    key_bounds, value_bounds = _boundaries(key_segments), _boundaries(value_segments)
    if key_bounds[-1] != value_bounds[-1]:
        raise ValueError(f"decode kernel: {key_bounds[-1]} cached keys but {value_bounds[-1]} values")
    key_encoded = tuple(not isinstance(s, torch.Tensor) for s in key_segments)
    value_encoded = tuple(not isinstance(s, torch.Tensor) for s in value_segments)
    step = step or DecodeStep()
    plan = step.plan(tuple(key_bounds), key_encoded, tuple(value_bounds), value_encoded, b * h, _multiprocessors(device),
                     block_tokens, num_splits)
    total = plan.slots
    if total == 0:
        return torch.zeros(b, hq, d, device=device, dtype=query.dtype), []
    out = torch.empty(b, hq, d, device=device, dtype=query.dtype)  # the merge writes every row
    partial, lse = step.workspace.scratch(device, region, b * h, total, r, d)
    placeholder = _placeholder(device)
    mask = dict(valid_ptr=placeholder, valid_s_b=0, MASKED=False)
    if valid is not None:
        valid = valid.to(device)
        valid = valid.view(torch.uint8) if valid.dtype == torch.bool and valid.stride(-1) == 1 else valid.to(torch.uint8).contiguous()
        mask = dict(valid_ptr=valid, valid_s_b=valid.stride(0), MASKED=True)
    no_rope = dict(positions=placeholder, pos_stride=0, inv_freq=placeholder, rope_scaling=1.0, ROPE=False, ROUND=0,
                   q0_ptr=placeholder, offset_ptr=placeholder, OFFSET=False)
    key_rotation = no_rope  # for encoded keys of pre-RoPE codecs (or their offset): shared by the step's launches
    rotary = key_rope if key_offset is None else key_offset[2]
    if rotary is not None:
        positions = rotary.positions.to(device, torch.int32)  # the cache's position ids, read in place
        positions = positions if positions.stride(-1) == 1 else positions.contiguous()
        key_rotation = dict(no_rope, positions=positions, pos_stride=positions.stride(0), rope_scaling=float(rotary.scaling),
                            inv_freq=rotary.inv_freq.to(device, torch.float32).contiguous(), ROPE=key_rope is not None,
                            ROUND=ROUNDING.get(rotary.dtype, 0))
    if key_offset is not None:
        key_rotation.update(q0_ptr=key_offset[0].reshape(b, h, r, d).contiguous(),
                            offset_ptr=key_offset[1].to(device, torch.float32).contiguous(), OFFSET=True)
    half_pad = max(16, triton.next_power_of_2(d // 2)) if dot else triton.next_power_of_2(d // 2)
    launches, slot, sketched_queries = [], 0, {}
    for planned in plan.launches:
        keys = next((key_segments[i] for i in planned.keys if key_encoded[i]), None)  # the launch's payloads, if any
        values = next((value_segments[i] for i in planned.values if value_encoded[i]), None)
        stream = {**_stream_args("k", key_segments, key_bounds, planned.keys, planned.hi, placeholder),
                  **_stream_args("v", value_segments, value_bounds, planned.values, planned.hi, placeholder),
                  **_sketch_args(keys, q, placeholder, sketched_queries, key_residual)}
        rope = no_rope if keys is None else key_rotation
        encoded = [s for s in (keys, values) if s is not None]
        args = dict(q_ptr=q, part_ptr=partial, lse_ptr=lse, **mask, H=h, R=r, lo=planned.lo, hi=planned.hi, tiles=planned.tiles,
                    unit=block_tokens, slot0=slot, num_slots=total, qk_scale=scale * LOG2E, **stream, **rope, D=d, HALF_PAD=half_pad,
                    BLOCK_R=block_r, BLOCK_T=_tile_tokens(block_tokens, *encoded, dot=dot), DOT=dot,
                    PACKED_K=keys is not None and keys.packed_scores(d, dot) and not rope["ROPE"],
                    PACKED_V=values is not None and values.packed_values(d, dot)
                    and not ((isinstance(keys, SketchReader) or key_residual is not None) and block_r > 4),
                    num_warps=num_warps, **registers)
        launches.append(Launch(_split_kernel, (b * h, planned.splits), args))
        slot += planned.splits
    merge = dict(part_ptr=partial, lse_ptr=lse, out_ptr=out, R=r, num_slots=total, D=d, BLOCK_R=block_r,
                 BLOCK_D=triton.next_power_of_2(d))
    launches.append(Launch(_merge_kernel, (b * h,), merge))
    return out, launches


def decode_attention_triton(query: torch.Tensor, key_segments: list[Segment], value_segments: list[Segment], scale: float,
                            valid: torch.Tensor | None = None, **options) -> torch.Tensor:
    """Same contract as :func:`~kvcomp.kernels.decode_attention.decode_attention_reference`: ``valid``
    ``[B, L]`` (bool, any pattern; ``None``: every cached token) is read by the kernel per token.
    ``options`` (``key_rope``, ``num_splits``, ``block_tokens``, ``dot``, ``num_warps``, ``step``): see
    :func:`decode_launches`.
    A :class:`RotatedReader`, :class:`OffsetReader` or :class:`ResidualSketchReader` payload is read in its own launches
    (:func:`_with_payload_group`; ``key_rope`` then gives the positions of a rotated key offset)."""
    if any(isinstance(s, OWN_LAUNCHES) for s in key_segments + value_segments):
        return _with_payload_group(query, key_segments, value_segments, scale, valid, **options)
    out, launches = decode_launches(query, key_segments, value_segments, scale, valid, **options)
    with launch_device(query.device):
        for launch in launches:
            launch()
    return out


@dataclass
class LaunchGroup:
    """The segments one group of split launches reads, and what is done to their partial outputs: ``rotation`` un-rotates
    them, ``offset`` (an :class:`OffsetReader` of values) adds its ``c_v``; ``options`` of :func:`decode_launches`.
    ``adds``: the group reads the previous group's keys in the same slices (the same log-sum-exps) and its partial
    outputs are added to that group's (a :class:`ResidualSketchReader`'s value sketch)."""

    query: torch.Tensor
    keys: list[Segment]
    values: list[Segment]
    valid: torch.Tensor | None
    rotation: torch.Tensor | None
    offset: OffsetReader | None
    options: dict
    adds: bool = False


def _with_payload_group(query, key_segments, value_segments, scale, valid, key_rope=None, step=None, **options) -> torch.Tensor:
    """Attention over a cache whose payload is stored in a rotated basis, less an offset or with a residual sketch
    (:func:`launch_groups`): the payload's partial outputs are un-rotated (``@ rotation_v``) where its values are and get
    a value offset's ``c_v`` (each a softmax average), and a values' sketch group's outputs, taken back to the values'
    basis, are added to them slice by slice; one merge combines all slices (their log-sum-exps do not depend on the
    basis)."""
    b, hq, d = query.shape
    partials, lses, merge, sliced = [], [], None, None
    with launch_device(query.device):
        step = step or DecodeStep()
        for region, group in enumerate(launch_groups(query, key_segments, value_segments, valid, key_rope, options)):
            _, launches = decode_launches(group.query, group.keys, group.values, scale, group.valid, step=step,
                                          region=region, **group.options)
            for launch in launches[:-1]:
                launch()
            if launches:
                merge = launches[-1]
                partial = merge.args["part_ptr"]
                h = partial.shape[0] // b
                if group.rotation is not None:  # [B*H, slots, R, D] by each KV head's rotation ([D, D] or [1 or H, D, D])
                    rotation = group.rotation.float().reshape(-1, 1, d, d)
                    partial = (partial.view(b, h, *partial.shape[1:]) @ rotation).view(partial.shape)
                if group.offset is not None:  # each slot's output is a softmax average: + c_v of its KV head
                    c_v = group.offset.offset.float().to(partial.device).view(1, h, 1, 1, d)
                    partial = (partial.view(b, h, *partial.shape[1:]) + c_v).view(partial.shape)
                slices = [(launch.grid, *(launch.args[k] for k in ("lo", "hi", "tiles", "unit"))) for launch in launches[:-1]]
                if group.adds:  # the same keys and slices as the previous group: its share of the same softmax
                    if slices != sliced:
                        raise ValueError("decode kernel: a value sketch's launches must slice the payload as its keys'")
                    partials[-1] = partials[-1] + partial
                    continue
                partials.append(partial)
                sliced = slices
                lses.append(merge.args["lse_ptr"])
        if merge is None:  # nothing cached
            return torch.zeros_like(query)
        out = torch.empty_like(query)  # the merge writes every row
        partial, lse = torch.cat(partials, 1), torch.cat(lses, 1)
        Launch(_merge_kernel, merge.grid, {**merge.args, "part_ptr": partial, "lse_ptr": lse, "out_ptr": out,
                                           "num_slots": partial.shape[1]})()
    return out


def launch_groups(query, key_segments, value_segments, valid=None, key_rope=None, options=None) -> list[LaunchGroup]:
    """The launch groups of a cache whose payload is stored in a rotated basis or less an offset: one segment of the
    keys and one of the values over the same tokens, either or both a :class:`RotatedReader` (vLLM's TurboQuant presets
    rotate only the keys), nested as ``OffsetReader(ResidualSketchReader(RotatedReader(...)))`` where present (``center``;
    TurboQuant-prod). First the payload's, which takes the query rotated (``q rotation_k^T``) where its keys are
    rotated and adds a key offset's score (``key_rope``: every cached token's position) and a residual sketch's; then the
    values' residual sketch over the same keys, if any (``adds``); then, if any, the other segments', which take the
    query as it is (``scripts/kernel_resources.py`` compiles the first)."""
    options = options or {}
    at = {i for segments in (key_segments, value_segments) for i, s in enumerate(segments) if isinstance(s, OWN_LAUNCHES)}
    key_bounds, value_bounds = _boundaries(key_segments), _boundaries(value_segments)
    i = min(at)
    if len(at) != 1 or i >= min(len(key_segments), len(value_segments)) or key_bounds[i: i + 2] != value_bounds[i: i + 2]:
        raise ValueError("decode kernel: a rotated or offset payload must be one post-RoPE segment of the keys and of the "
                         "values, over the same tokens")
    lo, hi = key_bounds[i], key_bounds[i + 1]
    keys, values = key_segments[i], value_segments[i]
    key_offset, value_offset = (s if isinstance(s, OffsetReader) else None for s in (keys, values))
    keys, values = (s.inner if isinstance(s, OffsetReader) else s for s in (keys, values))
    if key_offset is not None and not key_offset.rotated or value_offset is not None and value_offset.rotated:
        raise ValueError("decode kernel: a key offset is rotated to each token's position, a value offset is not")
    if (key_rope is None) != (key_offset is None):
        raise ValueError("decode kernel: a rotated payload's keys are post-RoPE; key_rope gives the positions of a "
                         "key offset, and only of one")
    key_sketch, value_sketch = (s if isinstance(s, ResidualSketchReader) else None for s in (keys, values))
    keys, values = (s.inner if isinstance(s, ResidualSketchReader) else s for s in (keys, values))
    key_rotation, value_rotation = (s.rotation if isinstance(s, RotatedReader) else None for s in (keys, values))
    keys, values = (s.inner if isinstance(s, RotatedReader) else s for s in (keys, values))
    b, hq, d = query.shape
    h = _kv_heads(keys)
    rotated = query
    if key_rotation is not None:
        rotated = (query.view(b, h, hq // h, d).float() @ key_rotation.transpose(-1, -2).float()).view(b, hq, d)
    payload_options = dict(options)
    if key_offset is not None:
        if key_rope.first != lo:
            raise ValueError(f"decode kernel: key_rope starts at cached token {key_rope.first}, the payload at {lo}")
        positions = key_rope.positions[:, lo:hi]  # the payload's tokens, from 0
        payload_options["key_offset"] = (query, key_offset.offset,
                                         RotaryPositions(positions, 0, key_rope.inv_freq, key_rope.scaling, key_rope.dtype))
    if key_sketch is not None:  # y = S q of the model's query, once for the payload's launches
        projection = key_sketch.projection.to(query.device, torch.float32)
        payload_options["key_residual"] = ((query.view(b, h, hq // h, d).float() @ projection.T).contiguous(),
                                           key_sketch.residual)
    payload_valid = None if valid is None else valid[:, lo:hi]
    if value_sketch is not None:  # both groups slice the payload alike: one tile size for both
        narrow = key_offset is not None or key_sketch is not None
        payload_options["block_tokens"] = (payload_options.get("block_tokens")
                                           or default_tile([keys, values, value_sketch.residual], narrow))
    groups = [LaunchGroup(rotated, [keys], [values], payload_valid, value_rotation, value_offset, payload_options)]
    if value_sketch is not None:  # the values' residual sketch, in its basis, over the same keys
        groups.append(LaunchGroup(rotated, [keys], [value_sketch.residual], payload_valid, value_sketch.basis, None,
                                  payload_options, adds=True))
    rest = (key_segments[:i] + key_segments[i + 1:], value_segments[:i] + value_segments[i + 1:])
    if rest[0]:
        groups.append(LaunchGroup(query, *rest, None if valid is None else torch.cat([valid[:, :lo], valid[:, hi:]], 1),
                                  None, None, options))
    return groups


def payload_launch_inputs(query, key_segments, value_segments, valid, key_rope, options) -> tuple:
    """``(query, keys, values, valid, key_rope, options)`` of :func:`decode_launches` for the launches that read the
    payload: the payload group's (:func:`launch_groups`) where it is rotated or stored less an offset, else as given
    (``scripts/kernel_resources.py`` and ``scripts/kernel_model.py`` compile them)."""
    if not any(isinstance(s, OWN_LAUNCHES) for s in key_segments + value_segments):
        return query, key_segments, value_segments, valid, key_rope, options
    group = launch_groups(query, key_segments, value_segments, valid, key_rope, options)[0]
    return group.query, group.keys, group.values, group.valid, None, group.options
